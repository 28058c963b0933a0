"""What keeping the default model's GGUF blocks costs and saves, per tensor type, on the CPU:

    PYTHONPATH=. python benchmarks/quant_error.py [--gguf FILE]

For each tensor type of SmolLM2-135M-Instruct.Q4_1.gguf: the number of tensors and weights, the
bytes as stored (blocks) against bf16, and the difference between the weights the dequantizing
GEMV multiplies by (tinyvllm/quant: one float32 value per weight, rounded once to bf16) and the
`gguf` package's float32 dequantization: the cost of the bf16 rounding, max and mean absolute
(beside the mean |weight|), and the largest relative to the weight. F32 tensors (the norms) are rounded to bf16 the same way.
A second table quantizes the bf16 weights of each matrix type to FP8 per channel (fp8.py) and
gives the same differences against the bf16 weights: the cost of FP8 on top of the file's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

from tinyvllm.checkpoint.gguf_tensors import read_gguf_weights
from tinyvllm.quant.block_format import BF16, QuantizedWeight
from tinyvllm.quant.fp8 import quantize_per_channel


class Stats:
    """Running totals of |ours - reference| over many tensors."""

    def __init__(self):
        self.tensors = self.weights = self.stored_bytes = 0
        self.max_abs = self.sum_abs = self.max_rel = self.sum_weight = 0.0

    def add(self, ours: np.ndarray, reference: np.ndarray, stored_bytes: int) -> None:
        diff = np.abs(ours.astype(np.float64) - reference.astype(np.float64))
        self.tensors += 1
        self.weights += diff.size
        self.stored_bytes += stored_bytes
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.sum_abs += float(diff.sum())
        self.sum_weight += float(np.abs(reference.astype(np.float64)).sum())
        nonzero = reference != 0
        if nonzero.any():
            self.max_rel = max(self.max_rel, float((diff[nonzero] / np.abs(reference[nonzero])).max()))


def measure(path: Path) -> tuple[dict[str, Stats], dict[str, Stats]]:
    reader = gguf.GGUFReader(path)
    ours = read_gguf_weights(path)
    bf16_cost: dict[str, Stats] = {}
    fp8_cost: dict[str, Stats] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        weight = ours[t.name]
        reference = np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32)
        if isinstance(weight, QuantizedWeight):
            w_bf16 = weight.dequantize_bf16()
            stored = weight.nbytes
        else:
            w_bf16 = np.asarray(weight, np.float32).astype(BF16)
            stored = weight.nbytes
        bf16_cost.setdefault(kind, Stats()).add(w_bf16, reference.reshape(w_bf16.shape), stored)
        if w_bf16.ndim == 2:
            fp8 = quantize_per_channel(w_bf16, t.name)
            fp8_cost.setdefault(kind, Stats()).add(fp8.dequantize(), w_bf16.astype(np.float32), fp8.nbytes)
    return bf16_cost, fp8_cost


def table(rows: dict[str, Stats], title: str, against: str) -> str:
    head = (f"{title}\n{'type':<6} {'tensors':>7} {'weights':>11} {'stored MB':>9} {'bf16 MB':>8} "
            f"{'bits/w':>6}  {'mean |w|':>9} {'max |diff|':>10} {'mean |diff|':>11} {'max rel':>8}   "
            f"(against {against})")
    lines = [head]
    for kind, s in sorted(rows.items()):
        lines.append(f"{kind:<6} {s.tensors:>7} {s.weights:>11,} {s.stored_bytes / 1e6:>9.2f} "
                     f"{2 * s.weights / 1e6:>8.2f} {8 * s.stored_bytes / s.weights:>6.2f}  "
                     f"{s.sum_weight / s.weights:>9.3e} {s.max_abs:>10.3e} {s.sum_abs / s.weights:>11.3e} {s.max_rel:>8.2e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, help="a GGUF file (default: the default model's)")
    args = parser.parse_args(argv)
    path = args.gguf
    if path is None:
        from tinyvllm.checkpoint.default_model import default_gguf_path
        path = default_gguf_path()
    bf16_cost, fp8_cost = measure(path)
    print(f"{path.name}\n")
    print(table(bf16_cost, "bf16 weights of the GEMV (one rounding of the float32 block value)",
                "gguf's float32 dequantization"))
    print()
    print(table(fp8_cost, "FP8 e4m3 per channel, quantized from those bf16 weights", "the bf16 weights"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
