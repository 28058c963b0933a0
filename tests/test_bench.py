"""`python -m tinyvllm bench` on the numpy backend with tiny workloads: the JSON has every number,
the numbers are sane, the table prints, the workloads are the issue's, and bad arguments are
one line with exit status 2."""
from __future__ import annotations

import json

import pytest

from tinyvllm.bench.run import BenchOptions, kv_blocks_needed, run_bench
from tinyvllm.bench.workloads import WARMUP, WORKLOADS, WorkloadResult, select_workloads
from tinyvllm.cli import main

SMALL = ["--device", "cpu", "--num-requests", "4", "--min-len", "4", "--max-len", "12"]
RESULT_KEYS = {"backend", "num_requests", "prompt_tokens", "output_tokens", "wall_s",
               "output_tok_s", "total_tok_s", "decode_tok_s", "ms_per_token", "ttft_ms",
               "preemptions", "note", "ttft_p99_ms", "prefix_cache_hit_rate", "cache_off",
               "outputs_identical"}


def test_cli_bench_writes_json_and_prints_the_table(tiny_model_dir, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    code = main(["bench", "--model", str(tiny_model_dir), *SMALL, "--json", str(out_json)])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out_json.read_text())
    assert {"date", "git_commit", "device", "model", "engine_config", "workloads"} <= report.keys()
    assert report["device"]["kind"] == "cpu" and report["device"]["floor_tok_s"] is None
    assert report["model"]["weight_bytes"] == 2 * report["model"]["num_parameters"] > 0
    assert report["engine_config"]["max_num_seqs"] == 256
    assert report["engine_config"]["max_num_batched_tokens"] == 16384
    assert list(report["workloads"]) == ["latency", "batch64", "throughput", "prefix"]
    for name, entry in report["workloads"].items():
        ours = entry["tinyvllm"]
        assert entry["hf"] is None and entry["vllm"] is None and entry["standard"] is False
        assert entry["ratios"] == {}
        assert set(ours) == RESULT_KEYS and ours["backend"] == "tinyvllm"
        assert ours["num_requests"] == (1 if name == "latency" else 4)
        assert ours["wall_s"] > 0 and ours["output_tok_s"] > 0
        assert ours["total_tok_s"] > ours["output_tok_s"]
        assert ours["preemptions"] == 0      # the KV cache is sized for the workloads
    latency = report["workloads"]["latency"]["tinyvllm"]
    assert latency["output_tokens"] == 12 and latency["prompt_tokens"] == 12
    assert latency["decode_tok_s"] > 0 and latency["ttft_ms"] > 0
    assert latency["ms_per_token"] == pytest.approx(1000 / latency["decode_tok_s"])
    # every request ran to its own max_tokens (ignore_eos): outputs are within [4, 12] each
    throughput = report["workloads"]["throughput"]["tinyvllm"]
    assert 4 * 4 <= throughput["output_tokens"] <= 4 * 12
    # prefix: a 12-token system prompt (capped by --max-len) + 4..12 own tokens, 12 new tokens,
    # run with the cache on and (nested) off; the shared blocks are computed once
    prefix = report["workloads"]["prefix"]["tinyvllm"]
    off = prefix["cache_off"]
    assert 4 * (12 + 4) <= prefix["prompt_tokens"] == off["prompt_tokens"] <= 4 * (12 + 12)
    assert prefix["output_tokens"] == off["output_tokens"] == 4 * 12
    assert prefix["outputs_identical"] is True and off["cache_off"] is None
    assert 0 < prefix["ttft_ms"] <= prefix["ttft_p99_ms"] and 0 < off["ttft_ms"] <= off["ttft_p99_ms"]
    # the 12 shared tokens fill no 16-token block: nothing to hit (see the block_size 4 test below)
    assert prefix["prefix_cache_hit_rate"] == 0.0 and off["prefix_cache_hit_rate"] is None
    assert report["workloads"]["latency"]["fraction_of_floor"] == {"tinyvllm": None, "hf": None, "vllm": None}
    for needle in ("workload", "decode tok/s (batch 1)", "fraction of the floor", "throughput",
                   "output tok/s", f"wrote {out_json}",
                   "TTFT p99 ms, cache off", "prefix cache hit rate", "greedy outputs, cache on = off | yes"):
        assert needle in out
    assert "HF" not in out and "vLLM" not in out    # no peer columns without --compare-*
    assert "target" not in out and ">=" not in out   # no absolute targets: they hold on one card only


def test_prefix_workload_computes_the_system_prompt_once(tiny_model_dir, capsys):
    """4-token blocks: the 12-token system prompt is 3 full blocks. The first request computes
    them (the others wait a step rather than compute them too), the other three hit all 3."""
    report = run_bench(BenchOptions(model=str(tiny_model_dir), workload="prefix", num_requests=4,
                                    min_len=4, max_len=12, engine_options={"device": "cpu", "block_size": 4}))
    prefix = report.workloads["prefix"]["tinyvllm"]
    assert prefix["prefix_cache_hit_rate"] == pytest.approx(3 * 12 / prefix["prompt_tokens"])
    assert prefix["outputs_identical"] is True and prefix["preemptions"] == prefix["cache_off"]["preemptions"] == 0
    assert "prefix cache hit rate" in capsys.readouterr().out


def test_one_workload_only(tiny_model_dir, capsys):
    report = run_bench(BenchOptions(model=str(tiny_model_dir), workload="batch64",
                                    engine_options={"device": "cpu"}, num_requests=2, max_len=6))
    assert list(report.workloads) == ["batch64"]
    result = report.workloads["batch64"]["tinyvllm"]
    assert result["output_tokens"] == 2 * 6 and result["prompt_tokens"] == 2 * 6
    assert "batch64" in capsys.readouterr().out


def test_preset_model_is_written_once_into_the_cache(tmp_path, capsys):
    args = ["bench", "--preset", "tiny", "--model-cache", str(tmp_path), "--workload", "latency",
            "--device", "cpu", "--max-len", "4"]
    assert main(args) == 0
    model_dir = tmp_path / "tiny"
    assert (model_dir / "config.json").is_file() and not list(tmp_path.glob(".*partial"))
    assert "writing the tiny model" in capsys.readouterr().err
    stamp = (model_dir / "config.json").stat().st_mtime_ns
    assert main(args) == 0
    assert (model_dir / "config.json").stat().st_mtime_ns == stamp
    assert "writing" not in capsys.readouterr().err


def test_default_workloads_are_the_issues():
    latency, batch64, throughput, prefix = select_workloads("all")
    assert (latency.num_requests, latency.prompt_len, latency.output_len) == (1, (128, 128), (256, 256))
    assert (batch64.num_requests, batch64.prompt_len, batch64.output_len) == (64, (128, 128), (128, 128))
    assert throughput.num_requests == 256
    assert throughput.prompt_len == throughput.output_len == (100, 1024)
    requests = throughput.requests(seed=0)
    assert requests == throughput.requests(seed=0)          # seeded: the same every run
    assert all(100 <= len(r.prompt_token_ids) <= 1024 and 100 <= r.max_tokens <= 1024 for r in requests)
    assert len({r.max_tokens for r in requests}) > 100       # ragged, not one length
    requests = prefix.requests(seed=0)
    system = requests[0].prompt_token_ids[:1024]
    assert len(requests) == 256 and all(r.prompt_token_ids[:1024] == system and r.max_tokens == 128
                                        and 1024 + 64 <= len(r.prompt_token_ids) <= 1024 + 256 for r in requests)
    assert len({tuple(r.prompt_token_ids[1024:1040]) for r in requests}) == 256     # own parts differ


def test_kv_cache_is_sized_for_the_worst_case_of_the_workloads():
    # 256 sequences of up to 1024 + 1024 tokens in 16-token blocks: 256 * 128 blocks (16 GiB at
    # Llama-3.2-1B's 32 KiB per token)
    assert kv_blocks_needed(select_workloads("all"), max_num_seqs=256, block_size=16) == 256 * 128
    assert kv_blocks_needed(select_workloads("latency"), 256, 16) == max(
        24, *(s.num_requests * -(-s.max_context // 16) for s in WARMUP))


def test_shrunk_workloads_keep_their_shape():
    latency, batch64, throughput, prefix = select_workloads("all", num_requests=4, min_len=4, max_len=12)
    assert (latency.num_requests, latency.prompt_len, latency.output_len) == (1, (12, 12), (12, 12))
    assert (batch64.num_requests, batch64.prompt_len) == (4, (12, 12))
    assert throughput.prompt_len == throughput.output_len == (4, 12)
    assert latency != WORKLOADS["latency"]
    assert (prefix.num_requests, prefix.shared_prefix, prefix.prompt_len, prefix.output_len) == \
        (4, 12, (4, 12), (12, 12))


def test_result_rates():
    r = WorkloadResult("tinyvllm", prompt_tokens=300, output_tokens=100, decode_tok_s=50.0).finish(2.0)
    assert (r.output_tok_s, r.total_tok_s, r.ms_per_token) == (50.0, 200.0, 20.0)


@pytest.mark.parametrize("args,message", [
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--min-len", "9", "--max-len", "5"], "--min-len 9 is larger than --max-len 5"),
    (["--max-len", "1"], "--max-len must be >= 2"),
    (["--model", "/no/such/dir"], "model directory not found"),
    (["--workload", "fastest"], "invalid choice"),
    (["--preset", "tiny", "--model", "/x"], "not allowed with argument"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--compare-hf", "--hf-max-seconds", "0"], "--hf-max-seconds must be > 0"),
])
def test_errors_are_one_line_with_exit_2(tiny_model_dir, capsys, args, message):
    if "--model" not in args and "--preset" not in args:
        args = ["--model", str(tiny_model_dir), *args]
    code = main(["bench", "--device", "cpu", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err
    assert len(err.strip().splitlines()) == 1, err


def test_compare_hf_without_torch_fails_before_running(tiny_model_dir, capsys, monkeypatch):
    import importlib.util
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real_find_spec(name, *a))
    code = main(["bench", "--model", str(tiny_model_dir), *SMALL, "--compare-hf"])
    out, err = capsys.readouterr()
    assert code == 2 and "--compare-hf needs torch" in err and "latency ..." not in err


def test_compare_hf_on_cpu(tiny_model_dir, tmp_path, capsys):
    """The HF side end to end where torch and transformers happen to be installed (they are not
    tinyvllm dependencies; the H200 image has them)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out_json = tmp_path / "bench.json"
    assert main(["bench", "--model", str(tiny_model_dir), *SMALL, "--compare-hf",
                 "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "tinyvllm/HF" in out
    for entry in json.loads(out_json.read_text())["workloads"].values():
        hf = entry["hf"]
        assert hf["backend"] == "hf" and hf["output_tok_s"] > 0, hf
        assert hf["output_tokens"] == entry["tinyvllm"]["output_tokens"]


def test_table_on_a_gpu_shows_fractions_of_the_floor_and_the_peers_ratios():
    """The GPU-only parts of the table, from a report built by hand: the floors (batch 1's and a
    workload's bytes floor), each engine's fraction of them, and tinyvllm's ratio to HF and to vLLM
    on every tok/s row."""
    from tinyvllm.bench.report import BenchReport, format_table
    report = BenchReport(date="d", git_commit="abc", engine_config={},
                         device={"kind": "cuda", "name": "NVIDIA H100", "copy_bandwidth_GBps": 3000.0,
                                 "floor_tok_s": 1200.0},
                         model={"path": "/m", "num_parameters": 1_235_814_400, "weight_bytes": 2_471_628_800},
                         hf={"torch": "t"}, vllm={"vllm": "0.26.0", "engine_start_s": 41.2,
                                                  "llm_options": {"dtype": "bfloat16", "max_model_len": 4096}})
    latency, batch64, throughput, prefix = select_workloads("all")
    report.add(latency, WorkloadResult("tinyvllm", 1, 128, 256, decode_tok_s=960.0).finish(0.3),
               WorkloadResult("hf", 1, 128, 256, decode_tok_s=12.0).finish(20.0),
               WorkloadResult("vllm", 1, 128, 256, decode_tok_s=480.0).finish(0.6))
    report.add(batch64, WorkloadResult("tinyvllm", 64, 8192, 8192).finish(0.25), None,
               WorkloadResult("vllm", 64, 8192, 8192).finish(0.5), floor_output_tok_s=65_536.0)
    skipped = WorkloadResult("hf", 256, note="skipped: estimated 300 s, 100 s left of --hf-max-seconds")
    cut = WorkloadResult("vllm", 256, note="cut off: --vllm-max-seconds 900 ran out")
    report.add(throughput, WorkloadResult("tinyvllm", 256, 1000, 100_000, preemptions=0).finish(4.0), skipped, cut)
    entry = report.workloads["latency"]
    assert entry["fraction_of_floor"] == pytest.approx({"tinyvllm": 0.8, "hf": 0.01, "vllm": 0.4})
    assert entry["ratios"]["vllm"]["decode_tok_s"] == pytest.approx(2.0)
    assert entry["ratios"]["hf"]["decode_tok_s"] == pytest.approx(80.0)
    assert report.workloads["batch64"]["ratios"] == {"vllm": pytest.approx({"output_tok_s": 2.0, "total_tok_s": 2.0})}
    assert report.workloads["throughput"]["ratios"] == {"hf": {}, "vllm": {}}
    table = format_table(report)
    lines = table.splitlines()
    assert "NVIDIA H100, copy bandwidth 3,000 GB/s" in lines[0] and "commit abc" in lines[0]
    assert [c.strip() for c in lines[1].split("|")] == ["workload", "metric", "tinyvllm", "HF", "tinyvllm/HF",
                                                       "vLLM", "tinyvllm/vLLM"]
    cells = {tuple(c.strip() for c in line.split("|")[:2]): [c.strip() for c in line.split("|")[2:]]
             for line in lines[3:] if "|" in line}
    assert cells[("latency", "decode tok/s (batch 1)")] == ["960", "12.0", "80.0x", "480", "2.00x"]
    assert cells[("latency", "bandwidth floor tok/s")] == ["1,200"]
    assert cells[("latency", "fraction of the floor")] == ["80.0%", "1.0%", "", "40.0%"]     # no ratio of ratios
    assert cells[("batch64", "output tok/s")] == ["32,768", "", "", "16,384", "2.00x"]
    assert cells[("batch64", "bytes floor output tok/s")] == ["65,536"]
    assert cells[("batch64", "fraction of the floor")] == ["50.0%", "", "", "25.0%"]
    assert not any(w == "throughput" and "floor" in m for w, m in cells)      # none given: no rows
    assert cells[("throughput", "output tok/s")] == ["25,000", "skipped", "", "cut off"]
    assert "HF throughput: skipped: estimated 300 s" in table
    assert "vLLM throughput: cut off: --vllm-max-seconds 900 ran out" in table
    assert "vLLM 0.26.0: LLM(dtype=bfloat16, max_model_len=4096)" in table and "ready in 41 s" in table
    assert "target" not in table and ">=" not in table
    back = json.loads(report.to_json())
    assert back["vllm"]["vllm"] == "0.26.0" and back["workloads"]["latency"]["vllm"]["decode_tok_s"] == 480.0


def test_prefix_table_shows_cache_on_against_off():
    from tinyvllm.bench.report import BenchReport, format_table
    report = BenchReport(date="d", git_commit="abc", engine_config={}, device={"kind": "cuda", "name": "H200",
                         "copy_bandwidth_GBps": None}, model={"path": "/m", "num_parameters": 1, "weight_bytes": 2})
    (prefix,) = select_workloads("prefix")
    off = WorkloadResult("tinyvllm", 256, 300_000, 32768, ttft_ms=900.0, ttft_p99_ms=1800.0).finish(8.0)
    on = WorkloadResult("tinyvllm", 256, 300_000, 32768, ttft_ms=150.0, ttft_p99_ms=360.0,
                        prefix_cache_hit_rate=0.85, cache_off=off, outputs_identical=True).finish(2.0)
    report.add(prefix, on, None)
    table = format_table(report)
    for needle in ("output tok/s                   | 16,384", "output tok/s, cache off        | 4,096 (cache: 4.00x)",
                   "TTFT p50 ms, cache off         | 900.0 (cache: 6.00x)", "TTFT p99 ms                    | 360.0",
                   "prefix cache hit rate          | 85.0%", "greedy outputs, cache on = off | yes"):
        assert needle in table, needle
    assert json.loads(report.to_json())["workloads"]["prefix"]["tinyvllm"]["cache_off"]["ttft_ms"] == 900.0


def test_a_tensor_parallel_report_names_its_gpus():
    """With N ranks the floors count N cards' bandwidth, and the table's first line says so."""
    from tinyvllm.bench.report import BenchReport, format_table
    report = BenchReport(date="d", git_commit="abc", engine_config={},
                         device={"kind": "cuda", "name": "NVIDIA H100", "copy_bandwidth_GBps": 3000.0, "gpus": 2,
                                 "floor_tok_s": 2400.0}, model={"path": "/m", "num_parameters": 1, "weight_bytes": 2})
    assert "copy bandwidth 3,000 GB/s (read + write) x 2 GPUs" in format_table(report).splitlines()[0]
