"""A plain (non-editable) `pip install .` must run: the wheel carries every CUDA source of the
top-level cuda/ folder (as tinyvllm/cuda/, where the kernels are compiled from at run time), the
chat templates and the license, and an installed copy finds its kernels and generates text with
no source tree in sight. And `make install` finds the CUDA toolkit for PyCUDA's build wherever
its nvcc lies (scripts/install_pycuda.py)."""
from __future__ import annotations

import importlib.util
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


# ---- scripts/install_pycuda.py: `make install` finds the CUDA toolkit for PyCUDA's build ----------

_spec = importlib.util.spec_from_file_location("install_pycuda", ROOT / "scripts" / "install_pycuda.py")
install_pycuda = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(install_pycuda)
find_toolkit = install_pycuda.find_toolkit


def fake_toolkit(folder: Path, *, libcuda_stub: bool = False, curand: bool = False) -> Path:
    """A folder shaped like a CUDA toolkit: include/cuda.h, bin/nvcc, lib64/ (and what is asked for)."""
    (folder / "include").mkdir(parents=True)
    (folder / "include" / "cuda.h").write_text("int cuInit(unsigned int flags);\n")
    (folder / "bin").mkdir()
    (folder / "bin" / "nvcc").write_text("#!/bin/sh\nexit 0\n")
    (folder / "bin" / "nvcc").chmod(0o755)
    (folder / "lib64").mkdir()
    if libcuda_stub:
        (folder / "lib64" / "stubs").mkdir()
        (folder / "lib64" / "stubs" / "libcuda.so").write_text("")
    if curand:
        (folder / "include" / "curand.h").write_text("")
        (folder / "lib64" / "libcurand.so").write_text("")
    return folder


def test_toolkit_from_environment_first(tmp_path):
    toolkit = fake_toolkit(tmp_path / "cuda-x")
    other = fake_toolkit(tmp_path / "cuda-y")
    env = {"CUDA_PATH": str(toolkit), "CUDA_ROOT": str(other), "PATH": str(other / "bin")}
    assert find_toolkit(env, standard_places=(other,)) == toolkit.resolve()
    with pytest.raises(install_pycuda.InstallError, match=r"CUDA_HOME=.*nowhere holds no CUDA toolkit"):
        find_toolkit({"CUDA_HOME": str(tmp_path / "nowhere"), "PATH": str(toolkit / "bin")}, standard_places=())


def test_toolkit_behind_a_linked_nvcc(tmp_path):
    toolkit = fake_toolkit(tmp_path / "cuda-13.0")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").symlink_to(toolkit / "bin" / "nvcc")
    assert find_toolkit({"PATH": str(tmp_path / "bin")}, standard_places=()) == toolkit.resolve()


def test_toolkit_behind_a_wrapper_nvcc(tmp_path):
    """/usr/local/bin/nvcc as a script that runs the real one: nvcc's own TOP= names the toolkit."""
    toolkit = fake_toolkit(tmp_path / "cuda-13.0")
    (tmp_path / "bin").mkdir()
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.write_text(f"#!/bin/sh\necho '#$ TOP={toolkit}/bin/..' >&2\n")
    wrapper.chmod(0o755)
    assert find_toolkit({"PATH": str(tmp_path / "bin")}, standard_places=()) == toolkit.resolve()


def test_toolkit_in_a_standard_place_or_none(tmp_path):
    toolkit = fake_toolkit(tmp_path / "opt-cuda")
    assert find_toolkit({"PATH": str(tmp_path)}, standard_places=(tmp_path / "none", toolkit)) == toolkit.resolve()
    assert find_toolkit({"PATH": str(tmp_path)}, standard_places=(tmp_path / "none",)) is None
    assert "only `--device cpu` will run" in install_pycuda.NO_TOOLKIT and "\n" not in install_pycuda.NO_TOOLKIT


def test_site_configuration_uses_the_toolkits_stub_and_curand_where_present(tmp_path):
    toolkit = fake_toolkit(tmp_path / "full", libcuda_stub=True, curand=True)
    settings = install_pycuda.site_configuration(toolkit, tmp_path / "unused")
    assert settings["CUDA_ROOT"] == str(toolkit) and settings["CUDA_INC_DIR"] == [str(toolkit / "include")]
    assert settings["CUDADRV_LIB_DIR"] == [str((toolkit / "lib64").resolve()), str((toolkit / "lib64" / "stubs").resolve())]
    assert settings["CUDA_ENABLE_CURAND"] is True
    assert not (tmp_path / "unused").exists()                      # the toolkit's own libcuda.so stub serves


@pytest.mark.skipif(not shutil.which(install_pycuda.compiler()), reason="needs a C compiler")
def test_driver_stub_when_nothing_provides_libcuda(tmp_path, monkeypatch):
    """No driver, no toolkit stub: the script's own stub exports every cu* function of cuda.h
    (after its #defines) under the driver's soname."""
    monkeypatch.setattr(install_pycuda, "linker_finds", lambda library, folders: False)
    toolkit = fake_toolkit(tmp_path / "bare")
    (toolkit / "include" / "cuda.h").write_text(
        "#define cuMemAlloc cuMemAlloc_v2\n"
        "typedef int CUresult;\n"
        "CUresult cuInit(unsigned int flags);\n"
        "CUresult cuMemAlloc(void **p, unsigned long n);\n"
        "typedef CUresult (*PFN_cuInit)(unsigned int);\n")
    (tmp_path / "stub").mkdir()
    settings = install_pycuda.site_configuration(toolkit, tmp_path / "stub")
    assert settings["CUDADRV_LIB_DIR"][-1] == str(tmp_path / "stub") and settings["CUDA_ENABLE_CURAND"] is False
    # Looked at from another process: loaded here, the stub would stand in for the driver
    # (same soname) for any GPU test that runs later in this one.
    probe = ("import ctypes, sys; stub = ctypes.CDLL(sys.argv[1]); "
             "print(*(hasattr(stub, n) for n in ('cuInit', 'cuMemAlloc_v2', 'cuMemAlloc', 'PFN_cuInit')))")
    proc = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "stub" / "libcuda.so")],
                          capture_output=True, text=True, check=True)
    assert proc.stdout.split() == ["True", "True", "False", "False"]
    assert b"libcuda.so.1" in (tmp_path / "stub" / "libcuda.so").read_bytes()   # the soname a driver answers to


def test_pycuda_requirement_is_the_gpu_extras():
    assert install_pycuda.pycuda_requirement().startswith("pycuda>=")
