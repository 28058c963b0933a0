"""`bench` under other values of one kernel file's launch constants, alternating with the code as it is.

    python3 benchmarks/constant_sweep.py --file attention_decode.cu \
        "THREADS=256" "THREADS=256,ONE_SPLIT_TOKENS=512" [--model DIR] [--rounds 2]

A kernel's launch constants (`constexpr int THREADS = 128;`) are read by its launcher from the
.cu file itself (gpu/kernels.py), so a variant is simply a copy of the package with those lines
rewritten: each variant gets its own copy in a temporary directory, and `python -m tinyvllm
bench --workload latency` runs on it with PYTHONPATH pointing there. "as is" (the checkout)
runs between them every round, so clock and thermal drift hit every setting alike. Each
setting's first run is a warm-up and is not reported: the first run after a compile (or the first
of a device call) was often 5-15 % low (perf-notes, session 13). A constant the file does not define is an error, never
skipped. Prints one table: decode tok/s per round, and ms per token of the median.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUDA_DIR = ROOT / "cuda"


def parse_variant(spec: str) -> dict[str, int]:
    """"K=V,K=V" -> {K: V}; integers only, as the launch constants are."""
    values = {}
    for item in spec.split(","):
        name, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_]\w*", name.strip()) or not re.fullmatch(r"-?\d+", value.strip()):
            raise ValueError(f"variant {spec!r}: each item must be NAME=INTEGER, got {item!r}")
        values[name.strip()] = int(value)
    return values


def rewrite_constants(source: str, values: dict[str, int]) -> str:
    """source with each `constexpr int NAME = ...;` of `values` set to its new value (the rest
    of the line, a comment, kept). Every name must be defined exactly once."""
    for name, value in values.items():
        pattern = re.compile(rf"^(\s*constexpr\s+int\s+{name}\s*=\s*)[^;]+;", re.M)
        source, count = pattern.subn(lambda m: f"{m.group(1)}{value};", source)
        if count != 1:
            raise ValueError(f"constant {name}: defined {count} times in the kernel file, expected once")
    return source


def package_copy(workdir: Path, filename: str, values: dict[str, int]) -> Path:
    """A copy of the tinyvllm package and the kernel folder beside it under workdir, with
    `filename`'s constants rewritten -> the directory to put on PYTHONPATH."""
    root = Path(tempfile.mkdtemp(dir=workdir))
    for folder in ("tinyvllm", "cuda"):
        shutil.copytree(ROOT / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    cu = root / "cuda" / filename
    cu.write_text(rewrite_constants(cu.read_text(), values))
    return root


def run_bench(pythonpath: Path, args) -> tuple[float, float] | None:
    """(decode tok/s, ms per token) of one `bench` run on the package under pythonpath."""
    cmd = [sys.executable, "-m", "tinyvllm", "bench", "--workload", "latency"]
    if args.model:
        cmd += ["--model", args.model]
    cmd += shlex.split(args.bench_args)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    rate = re.search(r"decode tok/s \(batch 1\)\s*\|\s*([\d,]+(?:\.\d+)?)", proc.stdout)
    ms = re.search(r"ms per token\s*\|\s*([\d.]+)", proc.stdout)
    if proc.returncode != 0 or not rate or not ms:
        print(f"  bench failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-400:]}", flush=True)
        return None
    return float(rate.group(1).replace(",", "")), float(ms.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+", help="NAME=INTEGER[,NAME=INTEGER...], one per variant")
    ap.add_argument("--file", required=True, help="the kernel file under cuda/, e.g. attention_decode.cu")
    ap.add_argument("--model", help="a model directory (default: bench's Llama-1B preset)")
    ap.add_argument("--bench-args", default="", help="more `bench` arguments, e.g. \"--preset tiny --device cpu\"")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=180, help="seconds per bench run")
    args = ap.parse_args()
    if not (CUDA_DIR / args.file).is_file():
        ap.error(f"--file: no kernel file {args.file!r} in {CUDA_DIR}")
    try:
        settings = [("as is", {})] + [(spec, parse_variant(spec)) for spec in args.variants]
        with tempfile.TemporaryDirectory() as tmp:
            paths = {name: ROOT if not values else package_copy(Path(tmp), args.file, values)
                     for name, values in settings}
            results: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in settings}
            for name, _ in settings:                      # warm-up: compile, first-run outliers
                print(f"warm-up [{name}]", flush=True)
                run_bench(paths[name], args)
            for r in range(args.rounds):
                for name, _ in settings:
                    result = run_bench(paths[name], args)
                    print(f"round {r + 1} [{name}]: {result}", flush=True)
                    if result:
                        results[name].append(result)
    except ValueError as e:
        print(f"constant_sweep: {e}", file=sys.stderr)
        return 2
    print(f"\n{args.file}, bench --workload latency{' --model ' + args.model if args.model else ''}")
    print(f"{'setting':<48} {'decode tok/s per round':<28} {'median ms/token':>15}")
    for name, _ in settings:
        runs = results[name]
        rates = " / ".join(f"{rate:,.0f}" for rate, _ in runs) or "failed"
        ms = f"{statistics.median(m for _, m in runs):.3f}" if runs else "-"
        print(f"{name:<48} {rates:<28} {ms:>15}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
