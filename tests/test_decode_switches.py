"""The two choices a user has over the GPU's decode path, checked on the CPU: EngineConfig's
fused_decode and pdl (documented fields, validated like the others), the --no-fused-decode and
--no-pdl flags of every engine command, and GpuOps.fuses_decode's rule for which decode steps run
the fused layer. (That the flags reach the launchers of a real CudaRunner:
tests/test_gpu_model.py::test_engine_config_switches_reach_the_launchers.)"""
from __future__ import annotations

import pytest

from tinyvllm.config import EngineConfig
from tinyvllm.errors import TinyVLLMError

ENGINE_COMMANDS = [["generate", "--model", "m", "x"], ["serve", "--model", "m"], ["bench"]]


def test_both_default_on_and_take_only_booleans():
    config = EngineConfig()
    assert config.fused_decode is True and config.pdl is True
    off = EngineConfig(fused_decode=False, pdl=False)
    assert off.fused_decode is False and off.pdl is False
    for name in ("fused_decode", "pdl"):
        for bad in ("no", 0, 1, None):
            with pytest.raises(ValueError, match=f"{name} must be true or false, got {bad!r}"):
                EngineConfig(**{name: bad})


def test_a_bad_value_given_to_the_engine_is_one_clear_error(tiny_model_dir):
    from tinyvllm.engine.llm_engine import LLMEngine
    with pytest.raises(TinyVLLMError, match="invalid engine option: fused_decode must be true or false"):
        LLMEngine(tiny_model_dir, device="cpu", fused_decode="off")


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_the_flags_parse_into_the_engine_config(command):
    from tinyvllm.cli import build_parser, engine_options_from_args
    from tinyvllm.engine.llm_engine import make_engine_config
    parse = lambda *flags: engine_options_from_args(build_parser().parse_args([*command, *flags]))  # noqa: E731
    unset = parse()
    assert "fused_decode" not in unset and "pdl" not in unset            # EngineConfig's defaults (on) apply
    config = make_engine_config(None, unset)
    assert config.fused_decode is True and config.pdl is True
    for flags, want in ((["--no-fused-decode"], (False, True)), (["--no-pdl"], (True, False)),
                        (["--no-fused-decode", "--no-pdl"], (False, False))):
        config = make_engine_config(None, parse(*flags))
        assert (config.fused_decode, config.pdl) == want, flags


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_the_flags_are_documented_in_the_help(command, capsys):
    from tinyvllm.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args([command[0], "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-fused-decode" in text and "nine-launch layer the guide follows" in text
    assert "--no-pdl" in text and "programmatic dependent launch" in text


class _NoLaunches:                  # a KernelLibrary no test here launches from
    def function(self, name):
        raise AssertionError(f"launched {name}")


def _shapes(hidden: int, q: int, kv: int, inter: int, vocab: int) -> dict[str, tuple[int, int]]:
    """The decode GEMVs' [n, k] weights, as LlamaModel.decode_gemv_shapes has them."""
    return {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden), "down": (hidden, inter),
            "lm_head": (vocab, hidden)}


def test_fuses_decode_where_its_kernels_can_run_every_projection():
    """The fused layer runs for decode steps of 1..8 sequences when fused_decode is on and its
    kernels take every shape: all five projections on the GEMV, head_dim a multiple of 16, gate_up's
    rows a multiple of 16, the hidden size a multiple of 64 (the prenormed GEMVs' row sums)."""
    from tinyvllm.gpu.ops import GpuOps
    ops = GpuOps(_NoLaunches(), num_sms=132)
    assert ops.fused_decode
    smollm2, llama_1b = _shapes(576, 576, 192, 1536, 49152), _shapes(2048, 2048, 512, 8192, 128256)
    for m in range(1, 9):
        assert ops.fuses_decode(m, smollm2, 64) and ops.fuses_decode(m, llama_1b, 64)
    assert not ops.fuses_decode(9, smollm2, 64)                        # past the GEMV's 8 rows: cuBLAS
    assert not ops.fuses_decode(1, smollm2, 8)                         # head_dim % 16
    assert not ops.fuses_decode(1, _shapes(576, 576, 192, 1540, 49152), 64)    # gate_up n = 3080
    assert not ops.fuses_decode(1, _shapes(544, 544, 136, 1536, 49152), 64)    # hidden % 64
    assert not ops.fuses_decode(1, _shapes(576, 576, 192, 1536, (1 << 30) + 1), 64)   # a head past the GEMV
    ops.fused_decode = False
    assert not any(ops.fuses_decode(m, smollm2, 64) for m in range(1, 9))
    assert not GpuOps(_NoLaunches(), num_sms=132, fused_decode=False).fuses_decode(1, llama_1b, 64)
    assert GpuOps(_NoLaunches(), num_sms=132, pdl=False).pdl is False
