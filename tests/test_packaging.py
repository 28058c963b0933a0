"""A plain (non-editable) `pip install .` must run: the wheel carries every CUDA source of the
top-level cuda/ folder (as tinyvllm/cuda/, where the kernels are compiled from at run time), the
chat templates and the license, and an installed copy finds its kernels and generates text with
no source tree in sight."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL_FILES = sorted(p.name for p in (ROOT / "cuda").iterdir() if p.suffix in (".cu", ".cuh"))
# Build outputs of an earlier in-tree build would leak stale files into the wheel: build from a copy.
NOT_SOURCES = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                     ".hypothesis", ".cache", ".gpu", ".whl", "*.cubin")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, tmp / "src", ignore=NOT_SOURCES)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp), str(tmp / "src")], check=True, capture_output=True)
    found, = tmp.glob("tinyvllm-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed (without its dependencies, which the test interpreter has) into a
    folder of its own -> that folder, to put first on PYTHONPATH."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                    "--target", str(target), str(wheel)], check=True, capture_output=True)
    return target


def run_from(pythonpath: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python args` with only `pythonpath`'s tinyvllm importable: run outside the source tree."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_kernel_folder_is_top_level():
    assert KERNEL_FILES, "no kernel sources found in cuda/"
    assert "common.cuh" in KERNEL_FILES
    stray = [str(p.relative_to(ROOT)) for p in (ROOT / "tinyvllm").rglob("*.cu*")]
    assert not stray, f"kernel files belong in the top-level cuda/ folder: {stray}"


def test_wheel_ships_every_kernel_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted(n.removeprefix("tinyvllm/cuda/") for n in names if n.startswith("tinyvllm/cuda/"))
    assert shipped == KERNEL_FILES
    assert not any(n.startswith("cuda/") for n in names), "a top-level cuda/ would collide with cuda-python"
    assert "tinyvllm/checkpoint/templates/llama-3.2-instruct.jinja" in names
    assert any(n.endswith("LICENSE") for n in names)


def test_installed_copy_finds_its_kernels(installed, tmp_path):
    probe = ("import tinyvllm, tinyvllm.gpu.kernels as k; print(tinyvllm.__file__); print(k.CUDA_DIR); "
             "print(' '.join(sorted(p.name for p in k.CUDA_DIR.iterdir())))")
    proc = run_from(installed, "-c", probe, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    package_file, kernel_dir, listing = proc.stdout.splitlines()
    assert Path(package_file).parent == installed / "tinyvllm"
    assert Path(kernel_dir) == installed / "tinyvllm" / "cuda"
    assert listing.split() == KERNEL_FILES


def test_installed_copy_generates_on_cpu(installed, tiny_model_dir, tmp_path):
    proc = run_from(installed, "-m", "tinyvllm", "generate", "--model", str(tiny_model_dir), "--device", "cpu",
                    "--max-tokens", "4", "Hello", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "4 generated tokens" in proc.stdout + proc.stderr


def test_missing_kernel_folder_is_one_clear_error(tmp_path):
    """A package copied without its kernels fails to load them with a message that names where it looked."""
    shutil.copytree(ROOT / "tinyvllm", tmp_path / "site" / "tinyvllm", ignore=NOT_SOURCES)
    proc = run_from(tmp_path / "site", "-c", "import tinyvllm.gpu.kernels", cwd=tmp_path)
    assert proc.returncode != 0
    assert "GPUUnavailableError: no CUDA kernel files (*.cu) in" in proc.stderr
    assert str(tmp_path / "site" / "tinyvllm" / "cuda") in proc.stderr and "reinstall tinyvllm" in proc.stderr
