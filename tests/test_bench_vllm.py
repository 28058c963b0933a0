"""`tinyvllm bench --compare-vllm` without vLLM: the real child process (bench/vllm_child.py) runs
against a stand-in `vllm` package written into a --vllm-site directory, which records what it was
given (options, environment, prompts) and sleeps in proportion to the tokens it is asked for. So
the parent's side (job, environment, process, timings, report) and the child's (requests, timing
calls, results file) run for real; only vLLM's engine is played."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap

import pytest

from tinyvllm.bench.vllm import make_job, result_from_timings, run_vllm_workloads
from tinyvllm.bench.vllm_child import engine_inputs
from tinyvllm.bench.workloads import select_workloads
from tinyvllm.cli import main

SMALL = ["--device", "cpu", "--num-requests", "4", "--min-len", "4", "--max-len", "12"]

FAKE_VLLM = '''
"""A stand-in for vLLM's offline API, for tests: it records every call in $FAKE_VLLM_LOG."""
import json, os, time
from types import SimpleNamespace

__version__ = "0.0.fake"
_calls = [0]


def _log(**entry):
    with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
        f.write(json.dumps(entry) + "\\n")


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        self.temperature, self.max_tokens, self.ignore_eos = temperature, max_tokens, ignore_eos


class LLM:
    def __init__(self, model, **options):
        _log(call="init", model=model, options=options,
             flashinfer_sampler=os.environ.get("VLLM_USE_FLASHINFER_SAMPLER"))

    def reset_prefix_cache(self):
        _log(call="reset")
        return True

    def generate(self, prompts, params, use_tqdm=True):
        _calls[0] += 1
        if _calls[0] == int(os.environ.get("FAKE_VLLM_FAIL_AT", 0)):
            raise RuntimeError("the fake engine fell over")
        _log(call="generate", prompts=[p["prompt_token_ids"] for p in prompts],
             params=[[p.temperature, p.max_tokens, p.ignore_eos] for p in params])
        time.sleep(float(os.environ.get("FAKE_VLLM_TOKEN_S", "0.002")) * max(p.max_tokens for p in params))
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7] * p.max_tokens)]) for p in params]
'''


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """A --vllm-site holding the stand-in vllm package; -> (site, the log it writes)."""
    site = tmp_path / "vsite"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    log = tmp_path / "fake-vllm.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    return site, log


def read_log(log) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_compare_vllm_runs_the_same_requests_in_a_child_process(tiny_model_dir, fake_site, tmp_path, capsys):
    site, log = fake_site
    out_json = tmp_path / "bench.json"
    code = main(["bench", "--model", str(tiny_model_dir), *SMALL, "--compare-vllm", "--vllm-site", str(site),
                 "--json", str(out_json)])
    out, err = capsys.readouterr()
    assert code == 0, err
    calls = read_log(log)
    init = calls[0]
    assert init["call"] == "init" and init["model"] == str(tiny_model_dir)
    assert init["options"] == {"dtype": "bfloat16", "gpu_memory_utilization": 0.8, "max_model_len": 4096}
    assert init["flashinfer_sampler"] == "0"
    # vLLM's environment and modules stay in the child
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ and "vllm" not in sys.modules
    # every timed generate starts from an empty prefix cache
    kinds = [c["call"] for c in calls[1:]]
    assert kinds == ["reset", "generate"] * (len(kinds) // 2)
    generates = [c for c in calls if c["call"] == "generate"]
    assert all(p[0] == 0.0 and p[2] is True for g in generates for p in g["params"])     # greedy, ignore_eos
    # after the two warm-up calls: latency (3 repeats of a 1-token and a full call), then one call
    # per workload, with the very requests tinyvllm ran
    latency, batch64, throughput, prefix = select_workloads("all", 4, 4, 12)
    timed = generates[2:]
    assert len(timed) == 6 + 3
    for call in timed[:6]:
        assert call["prompts"] == [latency.requests(0)[0].prompt_token_ids]
    assert [c["params"][0][1] for c in timed[:6]] == [1, 12] * 3
    for call, spec in zip(timed[6:], (batch64, throughput, prefix)):
        requests = spec.requests(0)
        assert call["prompts"] == [r.prompt_token_ids for r in requests]
        assert [p[1] for p in call["params"]] == [r.max_tokens for r in requests]

    report = json.loads(out_json.read_text())
    assert report["vllm"]["vllm"] == "0.0.fake" and report["vllm"]["engine_start_s"] >= 0
    assert report["vllm"]["llm_options"]["dtype"] == "bfloat16"
    for name, entry in report["workloads"].items():
        theirs, ours = entry["vllm"], entry["tinyvllm"]
        assert theirs["backend"] == "vllm" and theirs["note"] is None, theirs
        assert theirs["output_tokens"] == ours["output_tokens"] and theirs["prompt_tokens"] == ours["prompt_tokens"]
        assert theirs["output_tok_s"] > 0
        assert entry["ratios"]["vllm"]["output_tok_s"] == pytest.approx(ours["output_tok_s"] / theirs["output_tok_s"])
    lat = report["workloads"]["latency"]["vllm"]
    # the stand-in takes 2 ms a token: 11 tokens after the first in ~22 ms more than 1 token
    assert 0 < lat["decode_tok_s"] < 1000 and lat["ttft_ms"] > 0
    assert "tinyvllm/vLLM" in out and "vLLM 0.0.fake: LLM(dtype=bfloat16" in out
    assert "vLLM: batch64 ..." in err                     # the child's progress comes through


def test_a_failing_or_overrunning_vllm_leaves_notes_not_numbers(tiny_model_dir, fake_site, monkeypatch, capsys):
    site, _ = fake_site
    specs = select_workloads("all", 2, 4, 8)
    monkeypatch.setenv("FAKE_VLLM_FAIL_AT", "9")         # after 2 warm-up and 6 latency calls: batch64's
    results, about = run_vllm_workloads(tiny_model_dir, specs, seed=0, max_len=8, site=str(site), max_seconds=60)
    assert results["latency"].decode_tok_s > 0 and results["latency"].note is None
    for name in ("batch64", "throughput", "prefix"):
        assert results[name].output_tok_s is None
        assert results[name].note.startswith("failed: the vLLM process exited with status 1: RuntimeError: "
                                             "the fake engine fell over"), results[name].note
    assert about["vllm"] == "0.0.fake"
    monkeypatch.delenv("FAKE_VLLM_FAIL_AT")
    monkeypatch.setenv("FAKE_VLLM_TOKEN_S", "30")       # the first warm-up call would take minutes
    results, about = run_vllm_workloads(tiny_model_dir, specs, seed=0, max_len=8, site=str(site), max_seconds=3)
    assert all(r.note == "cut off: --vllm-max-seconds 3 ran out" for r in results.values())
    assert about["engine_start_s"] is not None           # it had started
    assert "vLLM: cut off" in capsys.readouterr().err


@pytest.mark.parametrize("site_kind,message", [
    ("empty", "--compare-vllm: vLLM is not importable in --vllm-site"),
    ("missing", "no such directory"),
])
def test_missing_vllm_is_one_line_before_any_run(tiny_model_dir, tmp_path, capsys, site_kind, message):
    if site_kind == "empty" and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    site = tmp_path / "site"
    if site_kind == "empty":
        site.mkdir()
    code = main(["bench", "--model", str(tiny_model_dir), *SMALL, "--compare-vllm", "--vllm-site", str(site)])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1, err       # and no tinyvllm run before it


def test_vllm_max_seconds_must_be_positive(tiny_model_dir, capsys):
    code = main(["bench", "--model", str(tiny_model_dir), *SMALL, "--compare-vllm", "--vllm-max-seconds", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "--vllm-max-seconds must be > 0" in err


def test_decode_rate_is_tokens_after_the_first_over_the_time_after_the_first():
    (latency,) = select_workloads("latency")
    requests = latency.requests(0)
    timings = {"walls": [0.30, 0.26, 0.28], "first_token_walls": [0.020, 0.024, 0.010], "output_tokens": 256}
    r = result_from_timings(latency, requests, timings, note="unused")
    assert r.wall_s == pytest.approx(0.28) and r.ttft_ms == pytest.approx(20.0)        # medians
    assert r.decode_tok_s == pytest.approx(255 / (0.28 - 0.020))
    assert r.ms_per_token == pytest.approx(1000 / r.decode_tok_s)
    assert r.prompt_tokens == 128 and r.output_tok_s == pytest.approx(256 / 0.28) and r.note is None
    missing = result_from_timings(latency, requests, None, note="cut off: x")
    assert missing.wall_s is None and missing.note == "cut off: x" and missing.prompt_tokens == 128


def test_job_and_engine_inputs():
    specs = select_workloads("all")
    job = make_job("/m", specs, seed=0, max_len=None)
    assert job["llm_options"]["max_model_len"] == 4096     # the workloads' longest context is 2,048
    throughput = job["workloads"][2]
    assert throughput["name"] == "throughput" and throughput["repeats"] == 1 and not throughput["single"]
    assert throughput["requests"] == [[r.prompt_token_ids, r.max_tokens] for r in specs[2].requests(0)]
    assert job["workloads"][0]["single"] and job["workloads"][0]["repeats"] == 3
    long = select_workloads("throughput", min_len=3000, max_len=3000)
    assert make_job("/m", long, seed=0, max_len=3000)["llm_options"]["max_model_len"] == 6000

    class Params:
        def __init__(self, **kw):
            self.kw = kw
    prompts, params = engine_inputs([[[1, 2, 3], 5], [[4], 9]], Params)
    assert prompts == [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4]}]
    assert [p.kw for p in params] == [{"temperature": 0.0, "max_tokens": 5, "ignore_eos": True},
                                      {"temperature": 0.0, "max_tokens": 9, "ignore_eos": True}]
    _, params = engine_inputs([[[1, 2, 3], 5], [[4], 9]], Params, max_tokens=1)
    assert [p.kw["max_tokens"] for p in params] == [1, 1]
