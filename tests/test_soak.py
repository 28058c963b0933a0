"""benchmarks/soak.py's CI size (--quick): a real `serve` subprocess on the numpy backend with a
KV cache small enough to force preemptions, under a mix of streamed, non-streamed, chat, seeded,
abandoned, disconnected and bad requests; its report must pass (no failures, no greedy mismatch
with the offline engine, preemptions, no KV block leaked, no traceback in the server log)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("scheduling", ["--no-async-scheduling", "--async-scheduling"])
def test_quick_soak_passes(tiny_model_dir, tmp_path, scheduling):
    """Both ways: numpy's default is sync, so the async run is what puts the server's aborts and
    disconnects against steps launched ahead on CI."""
    report_path = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--quick", scheduling,
                          "--model", str(tiny_model_dir), "--json", str(report_path),
                          "--server-log", str(tmp_path / "server.log")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert report_path.is_file(), run.stderr[-3000:]
    report = json.loads(report_path.read_text())
    print({k: report[k] for k in ("requests", "completed", "failed", "aborted", "refused_4xx",
                                  "mismatches", "preemptions", "kv_blocks_leaked", "rss_mb_after_warmup",
                                  "rss_mb_after", "health_p99_ms", "elapsed_s")})
    assert run.returncode == 0 and report["passed"], (report, run.stderr[-3000:])
    assert report["requests"] == report["completed"] + report["failed"] + report["aborted"] \
        + report["refused_4xx"]
    assert report["completed"] > 0 and report["aborted"] > 0 and report["compared"] > 0
    assert report["refused_4xx"] >= len(report["bad_request_statuses"]) + 2     # the bad ones, two huge
    assert all(400 <= s < 500 for s in report["bad_request_statuses"].values())
    assert report["failed"] == report["mismatches"] == report["kv_blocks_leaked"] == 0
    assert report["preemptions"] > 0 and report["exit_code"] == 0
    assert report["rss_mb_after"] > 0 and report["rss_mb_after_warmup"] > 0


def _soak_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("soak", module)        # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_departure_finds_a_fork_that_keeps_the_text():
    """soak.departure: a run that took '\\n\\n' as one token where the offline run took '\\n'
    twice prints the same text until later; the near-tie that explains it is at the fork, not
    where the texts part."""
    import numpy as np
    departure = _soak_module().departure
    pieces = {0: "a", 1: "\n", 2: "\n\n", 3: "b", 4: "c"}

    def decode(ids):
        return "".join(pieces[int(t)] for t in ids)

    prompt, offline = [0, 0], [0, 1, 1, 3]               # offline text "a\n\nb"

    def forward(runner_up_at_1):
        def forward_full(ids):
            logits = np.zeros((len(ids), 5))
            for i, token in enumerate(offline[:len(ids) - len(prompt) + 1]):
                logits[len(prompt) - 1 + i, token] = 3.0     # the offline pick, 3.0 ahead ...
            logits[len(prompt), runner_up_at_1] = 2.9        # ... but at token 1 a near-tie
            return logits
        return forward_full

    # the server printed "a\n\nc": by text it left at token 3 (gap 3.0 there) ...
    assert departure("a\n\nc", prompt, offline, decode, forward(4)) == (3, 3.0, 3)   # runner-up 'c': no fork
    j, gap, fork = departure("a\n\nc", prompt, offline, decode, forward(2))          # runner-up '\n\n'
    assert (j, fork) == (3, 1) and abs(gap - 0.1) < 1e-9
    assert departure("a\n\nb", prompt, offline, decode, forward(2)) is None          # same text in full


def test_bf16_noise_is_the_largest_logit_difference_over_every_sequence():
    """soak.bf16_noise: the near-tie bound's measured part, the largest |fp32 - bf16 twin| logit
    over all positions of all sequences (each model called on the same ids)."""
    import numpy as np
    bf16_noise = _soak_module().bf16_noise

    class Model:
        def __init__(self, offset):
            self.offset = offset

        def forward_full(self, ids):
            rows = np.arange(len(ids) * 3, dtype=np.float32).reshape(len(ids), 3)
            return rows + self.offset * np.float32(len(ids))

    assert bf16_noise(Model(0.0), Model(0.25), [[1, 2], [3, 4, 5, 6]]) == 1.0   # 0.25 x 4 positions
