"""The bench's report: every number in one JSON-able object, and the table printed at the end
(workload | metric | value | target | HF | tinyvllm/HF)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from tinyvllm.bench.workloads import WORKLOADS, WorkloadResult, WorkloadSpec


@dataclass
class BenchReport:
    date: str
    git_commit: str | None
    device: dict                       # kind, name, copy bandwidth, floor
    model: dict                        # path, parameters, weight bytes
    engine_config: dict
    workloads: dict = field(default_factory=dict)    # name -> {spec, standard, tinyvllm, hf}
    hf: dict | None = None             # torch / transformers versions and the time budget

    def add(self, spec: WorkloadSpec, tinyvllm: WorkloadResult, hf: WorkloadResult | None) -> None:
        self.workloads[spec.name] = {
            "spec": dataclasses.asdict(spec), "standard": spec == WORKLOADS[spec.name],
            "tinyvllm": dataclasses.asdict(tinyvllm),
            "hf": dataclasses.asdict(hf) if hf else None}
        if spec.name == "latency":
            floor = self.workloads["latency"]["floor_tok_s"] = self.device.get("floor_tok_s")
            self.workloads["latency"]["fraction_of_floor"] = \
                tinyvllm.decode_tok_s / floor if floor and tinyvllm.decode_tok_s else None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"


# (workload, result field, label, format); the tok/s rows get a tinyvllm/HF ratio
TABLE_ROWS = [
    ("latency", "decode_tok_s", "decode tok/s (batch 1)", "rate"),
    ("latency", "ms_per_token", "ms per token", "{:.3f}"),
    ("latency", "ttft_ms", "TTFT ms", "{:.1f}"),
    ("batch64", "output_tok_s", "output tok/s", "rate"),
    ("batch64", "total_tok_s", "total tok/s", "rate"),
    ("batch64", "wall_s", "wall s", "{:.2f}"),
    ("throughput", "output_tok_s", "output tok/s", "rate"),
    ("throughput", "total_tok_s", "total tok/s", "rate"),
    ("throughput", "wall_s", "wall s", "{:.2f}"),
    ("throughput", "preemptions", "preemptions", "{:d}"),
    ("prefix", "output_tok_s", "output tok/s", "rate"),          # then prefix_rows: on vs off
]


def table_rows(report: BenchReport) -> list[tuple[str, ...]]:
    rows = []
    for workload, key, label, fmt in TABLE_ROWS:
        entry = report.workloads.get(workload)
        if entry is None:
            continue
        spec, ours, hf = entry["spec"], entry["tinyvllm"], entry["hf"]
        value, hf_value = ours.get(key), (hf or {}).get(key)
        target = ""
        if key == spec["target_metric"]:
            target = f">= {spec['target']:,.0f}"
            if report.device["kind"] == "cuda" and entry["standard"]:   # the targets are the H200's
                target += " (met)" if value is not None and value >= spec["target"] else " (NOT met)"
        ratio = (f"{value / hf_value:.1f}x" if key.endswith("tok_s") and value and hf_value else "")
        hf_cell = "" if hf is None or key == "preemptions" else show(hf_value, fmt) \
            if hf_value is not None else (hf["note"] or "n/a").split(":")[0]
        rows.append((workload, label, show(value, fmt), target, hf_cell, ratio))
        if (workload, key) == ("latency", "decode_tok_s"):
            rows += floor_rows(report)
        if (workload, key) == ("prefix", "output_tok_s"):
            rows += prefix_rows(ours)
    return rows


def prefix_rows(on: dict) -> list[tuple[str, ...]]:
    """The prefix workload's cache-on numbers beside its cache-off ones, with the gain."""
    off = on["cache_off"] or {}

    def row(label, key, fmt, higher_is_better):
        a, b = on.get(key), off.get(key)
        gain = (a / b if higher_is_better else b / a) if a and b else None
        return [("prefix", label, show(a, fmt), "", "", ""),
                ("prefix", f"{label}, cache off", show(b, fmt) + (f" (cache: {gain:.2f}x)" if gain else ""),
                 "", "", "")]
    identical = {True: "yes", False: "NO", None: "n/a"}[on["outputs_identical"]]
    return [*row("output tok/s", "output_tok_s", "rate", True)[1:],
            *row("TTFT p50 ms", "ttft_ms", "{:.1f}", False), *row("TTFT p99 ms", "ttft_p99_ms", "{:.1f}", False),
            ("prefix", "prefix cache hit rate", show(on["prefix_cache_hit_rate"], "{:.1%}"), "", "", ""),
            ("prefix", "greedy outputs, cache on = off", identical, "", "", "")]


def floor_rows(report: BenchReport) -> list[tuple[str, ...]]:
    floor, fraction = report.workloads["latency"]["floor_tok_s"], report.workloads["latency"]["fraction_of_floor"]
    return [("latency", "bandwidth floor tok/s", show(floor, "rate"), "", "", ""),
            ("latency", "fraction of the floor", show(fraction, "{:.1%}"), "", "", "")]


def describe(report: BenchReport) -> str:
    device, model = report.device, report.model
    bandwidth = device["copy_bandwidth_GBps"]
    copy = f", copy bandwidth {bandwidth:,.0f} GB/s (read + write)" if bandwidth else ""
    return (f"{device['name']}{copy}; {model['path']}: {model['num_parameters'] / 1e9:.3f} B "
            f"parameters, {model['weight_bytes'] / 1e9:.2f} GB bf16; commit {report.git_commit or 'n/a'}")


def show(value, fmt: str) -> str:
    if value is None:
        return "n/a"
    if fmt == "rate":                  # tok/s: whole numbers, but HF's small ones keep a decimal
        fmt = "{:,.0f}" if value >= 100 else "{:.1f}"
    return fmt.format(value)


def format_table(report: BenchReport) -> str:
    header = ("workload", "metric", "value", "target", "HF", "tinyvllm/HF")
    rows = table_rows(report)
    if not any(r[4] for r in rows):
        header, rows = header[:4], [r[:4] for r in rows]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: " | ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
    lines = [describe(report), line(header), "-+-".join("-" * w for w in widths)] + [line(r) for r in rows]
    notes = [f"HF {name}: {e['hf']['note']}" for name, e in report.workloads.items()
             if e["hf"] and e["hf"]["note"]]
    return "\n".join([*lines, *notes]) + "\n"
