"""Install PyCUDA for `make install`, built against this machine's CUDA toolkit; on a machine
without one, install nothing and say in one line that only `--device cpu` will run.

PyCUDA has no Linux wheels, so pip builds it from source, and its build takes the toolkit to be the
folder above the one nvcc is in. That is wrong wherever nvcc is a link or a wrapper script outside
the toolkit (e.g. /usr/local/bin/nvcc running /usr/local/cuda-13.0/bin/nvcc): the build then stops
at `cuda.h: No such file or directory`. So this script finds the toolkit itself, the first folder
holding include/cuda.h among
  1. $CUDA_HOME, $CUDA_PATH, $CUDA_ROOT (the first one set; one that holds no toolkit is an error),
  2. the folder above nvcc's real location (links resolved), then the root nvcc reports itself
     (`nvcc --dryrun` prints TOP=..., seen through any wrapper script),
  3. /usr/local/cuda, /opt/cuda,
and writes PyCUDA's own build configuration (the siteconf.py its configure.py would write) into
its unpacked source before pip installs it. Two more things a toolkit may lack are handled there:
cuRAND (PyCUDA's wrapper of it is left out; tinyvllm never uses it), and libcuda.so, which the
link needs and only a driver or the toolkit's lib64/stubs provides: without either, the script
links against a stub of its own, an empty function for every function cuda.h declares, under the
driver's soname, so the real driver serves PyCUDA at run time.

Run it with the interpreter to install into: `python scripts/install_pycuda.py`.
"""
from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STANDARD_PLACES = (Path("/usr/local/cuda"), Path("/opt/cuda"))
ROOT_VARIABLES = ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT")
NO_TOOLKIT = ("No CUDA toolkit (include/cuda.h) found by CUDA_HOME, nvcc, /usr/local/cuda or /opt/cuda: "
              "tinyvllm is installed without PyCUDA, so only `--device cpu` will run.")


class InstallError(Exception):
    """A problem the user must fix, said in one line."""


def is_toolkit(folder: Path) -> bool:
    return (folder / "include" / "cuda.h").is_file()


def nvcc_reported_root(nvcc: str) -> Path | None:
    """The toolkit root nvcc itself uses (its TOP= line of a dry run), or None."""
    try:
        proc = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"^#\$ TOP=(.+)$", proc.stdout + proc.stderr, re.M)
    return Path(found.group(1).strip()).resolve() if found else None


def find_toolkit(environ=os.environ, standard_places=STANDARD_PLACES) -> Path | None:
    """The CUDA toolkit's root folder (the one holding include/cuda.h), or None where there is none."""
    for name in ROOT_VARIABLES:
        if environ.get(name):
            folder = Path(environ[name]).resolve()
            if not is_toolkit(folder):
                raise InstallError(f"{name}={environ[name]} holds no CUDA toolkit (no include/cuda.h): point it "
                                   "at one, or unset it")
            return folder
    candidates = []
    nvcc = shutil.which("nvcc", path=environ.get("PATH", ""))
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
        candidates.append(nvcc_reported_root(nvcc))
    candidates.extend(place.resolve() for place in standard_places)
    return next((folder for folder in candidates if folder and is_toolkit(folder)), None)


def library_folders(toolkit: Path) -> list[Path]:
    """The toolkit's library folders that exist, stubs last (as PyCUDA's own defaults order them)."""
    lib = ["lib64", "lib", "targets/x86_64-linux/lib"]
    names = lib + [f"{name}/stubs" for name in lib]
    folders = []
    for name in names:
        folder = (toolkit / name).resolve()
        if folder.is_dir() and folder not in folders:
            folders.append(folder)
    return folders


def linker_finds(library: str, folders: list[Path]) -> bool:
    """Whether `-l<library>` links with these folders added: a lib<library>.so in one of them, or
    one the compiler finds by itself (its default paths, $LIBRARY_PATH)."""
    filename = f"lib{library}.so"
    if any((folder / filename).exists() for folder in folders):
        return True
    found = subprocess.run([compiler(), f"-print-file-name={filename}"], capture_output=True, text=True).stdout
    return os.path.isabs(found.strip())


def compiler() -> str:
    return os.environ.get("CC") or "cc"


def write_driver_stub(include: Path, folder: Path) -> Path:
    """folder/libcuda.so for the linker alone (see the module docstring) -> its folder."""
    header = subprocess.run([compiler(), "-E", "-P", "-x", "c", "-I", str(include), str(include / "cuda.h")],
                            capture_output=True, text=True, check=True).stdout
    functions = sorted(set(re.findall(r"\b(cu[A-Z]\w*)\s*\(", header)))
    if not functions:
        raise InstallError(f"{include / 'cuda.h'} declares no cu* function: not a CUDA driver API header")
    source = folder / "libcuda_stub.c"
    source.write_text("".join(f"void {name}(void) {{}}\n" for name in functions))
    subprocess.run([compiler(), "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(folder / "libcuda.so"),
                    str(source)], check=True)
    return folder


def site_configuration(toolkit: Path, stub_folder: Path) -> dict[str, object]:
    """PyCUDA's build options (the names its setup.py reads from siteconf.py) for this toolkit."""
    folders = library_folders(toolkit)
    if not linker_finds("cuda", folders):
        folders.append(write_driver_stub(toolkit / "include", stub_folder))
    has_curand = (toolkit / "include" / "curand.h").is_file() and any(
        (folder / "libcurand.so").exists() for folder in folders)
    lib_dirs = [str(folder) for folder in folders]
    return {"CUDA_ROOT": str(toolkit), "CUDA_INC_DIR": [str(toolkit / "include")],
            "CUDADRV_LIB_DIR": lib_dirs, "CUDART_LIB_DIR": lib_dirs, "CURAND_LIB_DIR": lib_dirs,
            "CUDA_ENABLE_CURAND": has_curand}


def pycuda_requirement() -> str:
    """The `gpu` extra's PyCUDA requirement, read from setup.cfg (its one place)."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = config["options.extras_require"]["gpu"].split()
    return next(line for line in lines if line.lower().startswith("pycuda"))


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def install(toolkit: Path) -> None:
    if not shutil.which(compiler()):
        raise InstallError(f"PyCUDA builds from source with a C/C++ compiler, and `{compiler()}` is not on PATH: "
                           "install one (e.g. g++)")
    with tempfile.TemporaryDirectory(prefix="tinyvllm-pycuda-") as tmp:
        work = Path(tmp)
        pip("download", "-q", "--no-deps", "--no-binary", "pycuda", "-d", str(work), pycuda_requirement())
        sdist, = work.glob("pycuda-*.tar.gz")
        shutil.unpack_archive(sdist, work)
        source, = (p for p in work.glob("pycuda-*") if p.is_dir())
        settings = site_configuration(toolkit, work)
        (source / "siteconf.py").write_text("".join(f"{k} = {v!r}\n" for k, v in settings.items()))
        pip("install", "-q", str(source))


def main() -> int:
    try:
        version = metadata.version("pycuda")
        print(f"PyCUDA {version} is installed already (`pip uninstall pycuda` first to rebuild it).")
        return 0
    except metadata.PackageNotFoundError:
        pass
    try:
        toolkit = find_toolkit()
        if toolkit is None:
            print(NO_TOOLKIT)
            return 0
        print(f"Building PyCUDA against the CUDA toolkit in {toolkit} (a few minutes) ...", flush=True)
        install(toolkit)
    except InstallError as e:
        print(f"install_pycuda: {e}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as e:
        print(f"install_pycuda: `{' '.join(map(str, e.cmd))}` failed (exit {e.returncode})", file=sys.stderr)
        return 1
    if not shutil.which("nvcc"):
        print(f"PyCUDA compiles the kernels with nvcc at run time: put {toolkit / 'bin'} on PATH.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
