"""`python -m tinyvllm generate` on the numpy backend: happy paths and one-line errors."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tinyvllm.cli import main

CPU = ["--device", "cpu", "--num-kv-blocks", "64", "--max-model-len", "1024"]


def generate(capsys, *args):
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def error_lines(err: str) -> list[str]:
    """stderr without the engine's INFO lines (logged when it got as far as loading the model)."""
    return [line for line in err.strip().splitlines() if not line.startswith("INFO ")]


def test_single_prompt_streams_and_summarises(tiny_model_dir, capsys):
    code, out, err = generate(capsys, "--model", str(tiny_model_dir), *CPU, "--max-tokens", "6",
                              "--temperature", "0", "--ignore-eos", "Hello world")
    assert code == 0 and out.strip() and "---" not in out
    assert "1 requests" in err and "6 generated tokens" in err and "tok/s" in err and "TTFT" in err
    # the engine's log goes to stderr, INFO by default; stdout holds the text alone
    assert "parameters, engine ready in" in err and "maximum concurrency" in err
    assert "INFO" not in out and "[tinyvllm" not in out


def test_stream_is_the_same_text_as_batch_output(tiny_model_dir, capsys):
    args = ["--model", str(tiny_model_dir), *CPU, "--max-tokens", "5", "--temperature", "0.8",
            "--seed", "3", "--top-k", "50", "--top-p", "0.9", "--ignore-eos", "a cat", "a dog"]
    code, streamed, _ = generate(capsys, *args, "--stream")
    assert code == 0
    code, batched, err = generate(capsys, *args)
    assert code == 0 and streamed == batched
    assert batched.count("--- [") == 2 and "2/2 [" in err


def test_file_chat_system_and_stop(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\nthird prompt\n")
    code, out, err = generate(capsys, "--model", str(tiny_model_dir), *CPU, "--file", str(prompts),
                              "--chat", "--system", "Be brief.", "--max-tokens", "3",
                              "--stop", "zzz", "--scheduling", "static")
    assert code == 0 and out.count("--- [") == 3 and "'second prompt'" in out
    assert "3 requests" in err


def test_chat_template_file(tiny_model_dir, tmp_path, capsys):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    code, _, err = generate(capsys, "--model", str(tiny_model_dir), *CPU, "--chat-template", str(template),
                            "--system", "S", "--max-tokens", "1", "Hello")
    from tinyvllm.checkpoint.tokenizer import Tokenizer
    expected = Tokenizer.from_pretrained(tiny_model_dir).encode("system: S\nuser: Hello\n", add_special_tokens=False)
    assert code == 0 and f"1 requests, {len(expected)} prompt tokens" in err
    template.write_text("{% if messages %}{{ raise_exception('only for tools') }}{% endif %}")
    code, _, err = generate(capsys, "--model", str(tiny_model_dir), *CPU, "--chat-template", str(template), "Hi")
    assert code == 2 and len(error_lines(err)) == 1 and "only for tools" in err
    template.write_text("{% for m in messages %}")
    code, _, err = generate(capsys, "--model", str(tiny_model_dir), *CPU, "--chat-template", str(template), "Hi")
    assert code == 2 and "chat template syntax error" in err


@pytest.mark.parametrize("args,message", [
    (["--model", "/no/such/dir", "hi"], "model directory not found"),
    (["--model", "{model}", *CPU], "no prompt given"),
    (["--model", "{model}", *CPU, "--file", "/no/such/file", "hi"], "cannot read prompt file"),
    (["--model", "{model}", *CPU, "--temperature", "-2", "hi"], "temperature"),
    (["--model", "{model}", *CPU, "--top-p", "1.5", "hi"], "top_p"),
    (["--model", "{model}", *CPU, "--max-tokens", "0", "hi"], "max_tokens"),
    (["--model", "{model}", *CPU, "--max-model-len", "4", "a prompt longer than four tokens"],
     "context limit"),
    (["--model", "{model}", *CPU, "--max-num-seqs", "0", "hi"], "max_num_seqs"),
    (["--model", "{model}", "--device", "cuda", "hi"], "use --device cpu"),
])
def test_errors_are_one_line_with_exit_2(tiny_model_dir, capsys, args, message):
    args = [a.replace("{model}", str(tiny_model_dir)) for a in args]
    if "--device" in args and args[args.index("--device") + 1] == "cuda":
        try:
            import pycuda.driver as drv
            drv.init()
            if drv.Device.count():
                pytest.skip("a GPU is present: --device cuda works here")
        except Exception:
            pass
    code, out, err = generate(capsys, *args)
    assert code == 2 and message in err
    assert len(error_lines(err)) == 1 and "Traceback" not in err


@pytest.mark.parametrize("args", [["--top-k", "abc", "x"], ["x"], ["--bogus"]])
def test_argument_errors_are_one_line(tiny_model_dir, capsys, args):
    if args != ["x"]:
        args = ["--model", str(tiny_model_dir), *args]
    code, out, err = generate(capsys, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "error:" in err


def test_real_process_prints_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "tinyvllm", "generate", "--model",
                             str(tmp_path / "missing"), "hello"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("tinyvllm: error:")


@pytest.mark.parametrize("command", [["generate", "--model", "m", "x"], ["serve", "--model", "m"], ["bench"]])
def test_prefix_caching_flag_on_every_engine_command(command):
    from tinyvllm.cli import build_parser, engine_options_from_args
    parse = lambda *flags: engine_options_from_args(build_parser().parse_args([*command, *flags]))  # noqa: E731
    assert "enable_prefix_caching" not in parse()             # EngineConfig's default (on) applies
    assert parse("--no-enable-prefix-caching")["enable_prefix_caching"] is False
    assert parse("--enable-prefix-caching")["enable_prefix_caching"] is True


def test_generate_reports_prefix_cache_hits(tiny_model_dir, capsys):
    """Two identical prompts given together: the second waits a step and takes the first's full
    16-token blocks from the cache (all but the one holding its last token)."""
    from tinyvllm.checkpoint.tokenizer import Tokenizer
    from tinyvllm.config import ModelConfig
    prompt = " ".join(["one two three four five six seven eight nine ten"] * 4)
    n = len(Tokenizer.from_pretrained(tiny_model_dir, ModelConfig.from_pretrained(tiny_model_dir))
            .encode(prompt))
    code, _, err = generate(capsys, "--model", str(tiny_model_dir), *CPU, "--max-tokens", "2",
                            "--temperature", "0", prompt, prompt)
    hits = (n - 1) // 16 * 16
    assert code == 0 and hits >= 32 and f"prefix cache hits {hits}/{2 * n} tokens" in err
    code, _, err = generate(capsys, "--model", str(tiny_model_dir), *CPU, "--max-tokens", "2",
                            "--temperature", "0", "--no-enable-prefix-caching", prompt, prompt)
    assert code == 0 and "prefix cache" not in err


def test_cli_logging_is_undone_when_main_returns(capsys):
    import logging
    logger = logging.getLogger("tinyvllm")
    before = logger.level, logger.propagate, list(logger.handlers)
    assert main(["generate", "--model", "/no/such/model", "hi"]) == 2
    assert (logger.level, logger.propagate, list(logger.handlers)) == before   # caplog still works


def test_stop_takes_one_string_and_leaves_the_prompt_alone(tiny_model_dir, capsys):
    code, out, err = generate(capsys, "--model", str(tiny_model_dir), *CPU, "--max-tokens", "2",
                              "--stop", "zzz", "Hello there")
    assert code == 0 and "1 requests" in err


def test_sampling_feature_flags_give_the_offline_api_s_text(tiny_model_dir, capsys):
    """--repetition-penalty / --presence-penalty / --frequency-penalty / --min-p / --min-tokens
    reach SamplingParams: the printed text is LLM.generate's with the same fields."""
    from tinyvllm import LLM, SamplingParams
    flags = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, min_p=0.05, min_tokens=3)
    args = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    code, out, _ = generate(capsys, "--model", str(tiny_model_dir), *CPU, "--max-tokens", "8",
                            "--temperature", "0", "--ignore-eos", *args, "Hello world")
    llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, max_model_len=1024)
    try:
        expected = llm.generate("Hello world", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                             **flags), use_tqdm=False)[0].outputs[0].text
        plain = llm.generate("Hello world", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].text
    finally:
        llm.engine.close()
    assert code == 0 and out.rstrip("\n") == expected and expected != plain
