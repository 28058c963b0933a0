"""Start-up refuses what it cannot honour, in one line: engine options out of range, a KV cache
that cannot hold one max_model_len sequence (unless max_model_len="auto" asked for the limit to
be lowered), a tokenizer with more tokens than the model has embeddings."""
from __future__ import annotations

import json
import logging
import shutil

import pytest

from tinyvllm.cli import main
from tinyvllm.config import EngineConfig
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.errors import ModelLoadError, TinyVLLMError


@pytest.mark.parametrize("options, message", [
    (dict(num_kv_blocks=0), r"num_kv_blocks must be an integer in \[1, "),
    (dict(num_kv_blocks=-1), r"num_kv_blocks must be an integer in \[1, "),
    (dict(num_kv_blocks=2**31), r"num_kv_blocks must be an integer in \[1, "),
    (dict(max_num_seqs="8"), "max_num_seqs must be an integer"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an integer"),
    (dict(max_model_len=0), r"max_model_len must be an integer in \[1, \d+\] or 'auto'"),
    (dict(max_model_len="big"), "max_model_len must be an integer"),
    (dict(kv_cache_gb=float("nan")), "kv_cache_gb must be a finite number"),
    (dict(kv_cache_gb=0), "kv_cache_gb must be > 0"),
    (dict(gpu_memory_utilization=float("inf")), "gpu_memory_utilization must be a finite number"),
    (dict(seed=-1), "seed must be an integer"),
    (dict(enforce_eager="yes"), "enforce_eager must be true or false"),
])
def test_engine_options_out_of_range_are_one_clear_error(tiny_model_dir, options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", **options)
    with pytest.raises(TinyVLLMError, match="invalid engine option: " + message):
        LLMEngine(tiny_model_dir, device="cpu", **options)


def test_a_kv_cache_smaller_than_one_context_is_refused(tiny_model_dir):
    with pytest.raises(TinyVLLMError, match=r"KV cache holds 128 tokens \(8 blocks of 16\), less than "
                                            r"one sequence of max_model_len=4096.*--max-model-len auto"):
        LLMEngine(tiny_model_dir, device="cpu", num_kv_blocks=8)
    with pytest.raises(TinyVLLMError, match="max_model_len=256"):
        LLMEngine(tiny_model_dir, device="cpu", num_kv_blocks=8, max_model_len=256)
    fits = LLMEngine(tiny_model_dir, device="cpu", num_kv_blocks=8, max_model_len=128)
    assert fits.context_limit == 128


def test_max_model_len_auto_lowers_the_limit_with_a_warning(tiny_model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="tinyvllm"):
        engine = LLMEngine(tiny_model_dir, device="cpu", num_kv_blocks=8, max_model_len="auto")
    assert engine.context_limit == 128 and engine.engine_config.max_model_len == 128
    assert engine.engine_config.context_limit(engine.model_config) == 128   # what the server reads
    assert "max_model_len lowered from 4096 to 128" in caplog.text
    roomy = LLMEngine(tiny_model_dir, device="cpu", num_kv_blocks=512, max_model_len="auto")
    assert roomy.context_limit == 4096


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tiny_model_dir, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["vocab_size"] = 1000
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"tokenizer.json has 128256 tokens but config.json's "
                                             r"vocab_size is 1000"):
        LLMEngine(tmp_path, device="cpu")


@pytest.mark.parametrize("args, message", [
    (["--num-kv-blocks", "0"], "num_kv_blocks must be an integer in [1, "),
    (["--num-kv-blocks", "-1"], "num_kv_blocks must be an integer in [1, "),
    (["--num-kv-blocks", "4"], "KV cache holds 64 tokens"),
    (["--max-model-len", "lots"], "expected an integer or 'auto'"),
])
def test_cli_start_up_errors_are_one_line_with_exit_2(tiny_model_dir, capsys, args, message):
    code = main(["generate", "--model", str(tiny_model_dir), "--device", "cpu", *args, "Hello"])
    err = capsys.readouterr().err
    # stderr may carry the engine's INFO log lines; the failure itself is one error line
    errors = [line for line in err.splitlines() if line.startswith("tinyvllm") and "error:" in line]
    assert code == 2 and len(errors) == 1 and message in errors[0] and "Traceback" not in err, err


def test_cli_max_model_len_auto(tiny_model_dir, capsys):
    code = main(["generate", "--model", str(tiny_model_dir), "--device", "cpu", "--num-kv-blocks", "4",
                 "--max-model-len", "auto", "--max-tokens", "3", "--temperature", "0", "Hello"])
    assert code == 0 and "1 requests" in capsys.readouterr().err
