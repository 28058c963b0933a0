"""A plain (non-editable) `pip install .` must run: the wheel carries every CUDA source the
kernels are compiled from at run time, and the license."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_every_kernel_source(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    wheel, = tmp_path.glob("tinyvllm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted((ROOT / "tinyvllm" / "gpu" / "cuda").iterdir())
    assert sources, "no kernel sources found"
    for path in sources:
        assert f"tinyvllm/gpu/cuda/{path.name}" in names, f"{path.name} is missing from the wheel"
    assert any(n.endswith("LICENSE") for n in names)
