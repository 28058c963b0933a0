"""benchmarks/constant_sweep.py's rewriting of a kernel file's launch constants (CPU only)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from tinyvllm.gpu.kernels import CUDA_DIR, kernel_constants

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("constant_sweep", ROOT / "benchmarks" / "constant_sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


def test_parse_variant():
    assert sweep.parse_variant("THREADS=256") == {"THREADS": 256}
    assert sweep.parse_variant("THREADS=256, ONE_SPLIT_TOKENS=512") == {"THREADS": 256, "ONE_SPLIT_TOKENS": 512}
    for bad in ("THREADS", "THREADS=2.5", "=3", "THREADS=256,", "1X=2"):
        with pytest.raises(ValueError):
            sweep.parse_variant(bad)


def test_rewrite_keeps_comments_and_derived_constants():
    source = (CUDA_DIR / "attention_decode.cu").read_text()
    base = kernel_constants("attention_decode.cu")
    assert base["THREADS"] != 512                                    # a real change below
    out = sweep.rewrite_constants(source, {"THREADS": 512, "STAGES": 4})
    consts = dict(re.findall(r"constexpr int (\w+) = ([^;]+);", out))
    assert consts["THREADS"] == "512" and consts["STAGES"] == "4"
    assert consts["WARPS"] == "THREADS / 32"                        # derived: follows THREADS
    assert "constexpr int STAGES = 4;                         // cp.async ring depth per warp" in out
    assert out.count("\n") == source.count("\n")                   # no line added or lost
    assert sweep.rewrite_constants(out, {"THREADS": base["THREADS"], "STAGES": base["STAGES"]}) == source


def test_rewrite_rejects_unknown_constant():
    source = (CUDA_DIR / "attention_decode.cu").read_text()
    with pytest.raises(ValueError, match="NO_SUCH"):
        sweep.rewrite_constants(source, {"NO_SUCH": 1})


def test_package_copy_is_what_the_launcher_reads(tmp_path):
    root = sweep.package_copy(tmp_path, "attention_decode.cu", {"ONE_SPLIT_TOKENS": 1024})
    text = (root / "cuda" / "attention_decode.cu").read_text()
    assert "constexpr int ONE_SPLIT_TOKENS = 1024;" in text
    assert (root / "cuda" / "gemv.cu").read_text() == (CUDA_DIR / "gemv.cu").read_text()
