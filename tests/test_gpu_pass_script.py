"""benchmarks/gpu_pass.sh's kernel-ab step, on the CPU with a stand-in python3 that reports which
kernel file it found: each side of the A/B runs on its own files, the checkout's files come back
afterwards, and differing file names are refused (the GPU machine's copy has no git history, so
the other side's files come from a directory)."""
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAND_IN = "#!/bin/bash\necho \"latency | decode tok/s | $(cat cuda/b.cu) $(cat cuda/a.cu)\"\n"


def kernel_ab(tmp_path: Path, base_files: dict, rounds: int = 2) -> list[str]:
    for name, text in {"cuda/a.cu": "A", "cuda/b.cu": "B-this", "bin/python3": STAND_IN,
                       **{f"base/{n}": t for n, t in base_files.items()}}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "bin/python3").chmod(0o755)
    (tmp_path / "benchmarks").mkdir(exist_ok=True)
    shutil.copy(ROOT / "benchmarks/gpu_pass.sh", tmp_path / "benchmarks/gpu_pass.sh")
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "OUT": str(tmp_path / "out"), "BASE_CUDA": "base",
           "ROUNDS": str(rounds)}
    r = subprocess.run(["bash", "benchmarks/gpu_pass.sh", "kernel-ab"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def test_kernel_ab_runs_each_side_on_its_own_files_and_restores_the_checkout(tmp_path):
    lines = kernel_ab(tmp_path, {"a.cu": "A", "b.cu": "B-base"})
    assert lines[0] == "== kernel-ab: 1 kernel files differ: cuda/b.cu"
    sides = [(line.split("[")[1].split()[0], line.split("| ")[-1]) for line in lines[1:]]
    assert sides == [("base", "B-base A"), ("this", "B-this A")] * 2
    assert (tmp_path / "cuda/b.cu").read_text() == "B-this"


def test_kernel_ab_refuses_kernel_files_added_or_removed(tmp_path):
    lines = kernel_ab(tmp_path, {"a.cu": "A", "b.cu": "B-base", "c.cu": "C"})
    assert len(lines) == 1 and "different file names" in lines[0] and "use tree-ab" in lines[0]
    assert (tmp_path / "cuda/b.cu").read_text() == "B-this"
