"""The bench's report: every number in one JSON-able object, and the table printed at the end
(workload | metric | tinyvllm | HF | tinyvllm/HF | vLLM | tinyvllm/vLLM, the peers' columns only
when they ran).

No absolute targets: a tok/s figure means little without its card. What holds on any card is
in the table instead: each rate as a fraction of its floor on the machine at hand (batch-1 decode:
the bandwidth floor of bench/machine.py's copy bandwidth; the other workloads: bench/floor.py's
bytes floor), and tinyvllm's ratio to each peer run beside it on the same card."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from tinyvllm.bench.workloads import WORKLOADS, WorkloadResult, WorkloadSpec

PEERS = (("hf", "HF"), ("vllm", "vLLM"))      # (report key, column label), in column order


@dataclass
class BenchReport:
    date: str
    git_commit: str | None
    device: dict                       # kind, name, copy bandwidth, floor
    model: dict                        # path, parameters, weight bytes
    engine_config: dict
    workloads: dict = field(default_factory=dict)    # name -> {spec, standard, tinyvllm, hf, vllm, ratios}
    hf: dict | None = None             # torch / transformers versions and the time budget
    vllm: dict | None = None           # vLLM's version, its LLM options, its start-up time

    def add(self, spec: WorkloadSpec, tinyvllm: WorkloadResult, hf: WorkloadResult | None = None,
            vllm: WorkloadResult | None = None, floor_output_tok_s: float | None = None) -> None:
        """floor_output_tok_s: the workload's bytes floor (bench/floor.py); batch 1's is the device's."""
        ours = dataclasses.asdict(tinyvllm)
        peers = {"hf": dataclasses.asdict(hf) if hf else None, "vllm": dataclasses.asdict(vllm) if vllm else None}
        entry = self.workloads[spec.name] = {
            "spec": dataclasses.asdict(spec), "standard": spec == WORKLOADS[spec.name], "tinyvllm": ours,
            **peers, "ratios": {key: rate_ratios(ours, peer) for key, peer in peers.items() if peer}}
        rate = "decode_tok_s" if spec.name == "latency" else "output_tok_s"
        floor = entry["floor_tok_s"] = self.device.get("floor_tok_s") if spec.name == "latency" else floor_output_tok_s
        entry["fraction_of_floor"] = {
            name: result[rate] / floor if floor and result and result[rate] else None
            for name, result in (("tinyvllm", ours), *peers.items())}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"


def rate_ratios(ours: dict, peer: dict) -> dict:
    """tinyvllm / peer for every tok/s figure both have."""
    return {key: ours[key] / peer[key] for key in ours
            if key.endswith("tok_s") and ours[key] and peer.get(key)}


# (workload, result field, label, format); the tok/s rows get a tinyvllm/peer ratio
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


def peer_cells(entry: dict, key: str, value, fmt: str) -> list[str]:
    """[peer value, tinyvllm/peer] for each peer in PEERS; a peer without the number shows why."""
    cells = []
    for peer, _ in PEERS:
        result = entry[peer]
        if result is None or key == "preemptions":
            cells += ["", ""]
            continue
        theirs = result.get(key)
        shown = show(theirs, fmt) if theirs is not None else (result["note"] or "n/a").split(":")[0]
        ratio = show_ratio(value / theirs) if key.endswith("tok_s") and value and theirs else ""
        cells += [shown, ratio]
    return cells


def table_rows(report: BenchReport) -> list[tuple[str, ...]]:
    rows = []
    for workload, key, label, fmt in TABLE_ROWS:
        entry = report.workloads.get(workload)
        if entry is None:
            continue
        value = entry["tinyvllm"].get(key)
        rows.append((workload, label, show(value, fmt), *peer_cells(entry, key, value, fmt)))
        if (workload, key) == ("prefix", "output_tok_s"):
            rows += prefix_rows(entry["tinyvllm"])
        if key in ("decode_tok_s", "output_tok_s"):
            rows += floor_rows(workload, entry)
    return rows


def floor_rows(workload: str, entry: dict) -> list[tuple[str, ...]]:
    """The workload's floor (batch 1: the bandwidth floor; the others: the bytes floor of
    bench/floor.py), and each engine's rate as a fraction of it; none where no floor was measured
    (on a CPU, or a report without one)."""
    if workload != "latency" and entry.get("floor_tok_s") is None:
        return []
    fraction = entry["fraction_of_floor"]
    peers = [cell for peer, _ in PEERS for cell in (show(fraction.get(peer), "{:.1%}") if entry[peer] else "", "")]
    label = "bandwidth floor tok/s" if workload == "latency" else "bytes floor output tok/s"
    return [(workload, label, show(entry["floor_tok_s"], "rate"), *[""] * 2 * len(PEERS)),
            (workload, "fraction of the floor", show(fraction["tinyvllm"], "{:.1%}"), *peers)]


def prefix_rows(on: dict) -> list[tuple[str, ...]]:
    """The prefix workload's cache-on numbers beside its cache-off ones, with the gain."""
    off = on["cache_off"] or {}
    blank = [""] * 2 * len(PEERS)

    def row(label, key, fmt, higher_is_better):
        a, b = on.get(key), off.get(key)
        gain = (a / b if higher_is_better else b / a) if a and b else None
        return [("prefix", label, show(a, fmt), *blank),
                ("prefix", f"{label}, cache off", show(b, fmt) + (f" (cache: {gain:.2f}x)" if gain else ""), *blank)]
    identical = {True: "yes", False: "NO", None: "n/a"}[on["outputs_identical"]]
    return [*row("output tok/s", "output_tok_s", "rate", True)[1:],
            *row("TTFT p50 ms", "ttft_ms", "{:.1f}", False), *row("TTFT p99 ms", "ttft_p99_ms", "{:.1f}", False),
            ("prefix", "prefix cache hit rate", show(on["prefix_cache_hit_rate"], "{:.1%}"), *blank),
            ("prefix", "greedy outputs, cache on = off", identical, *blank)]


def describe(report: BenchReport) -> str:
    device, model = report.device, report.model
    bandwidth = device["copy_bandwidth_GBps"]
    copy = f", copy bandwidth {bandwidth:,.0f} GB/s (read + write)" if bandwidth else ""
    if device.get("gpus", 1) > 1:
        copy += f" x {device['gpus']} GPUs (tensor parallel; the floors count them all)"
    return (f"{device['name']}{copy}; {model['path']}: {model['num_parameters'] / 1e9:.3f} B "
            f"parameters, {model['weight_bytes'] / 1e9:.2f} GB of weights a decode step; commit {report.git_commit or 'n/a'}")


def show(value, fmt: str) -> str:
    if value is None:
        return "n/a"
    if fmt == "rate":                  # tok/s: whole numbers, but HF's small ones keep a decimal
        fmt = "{:,.0f}" if value >= 100 else "{:.1f}"
    return fmt.format(value)


def show_ratio(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio < 10 else f"{ratio:.1f}x"


def format_table(report: BenchReport) -> str:
    header = ("workload", "metric", "tinyvllm", *[c for _, label in PEERS for c in (label, f"tinyvllm/{label}")])
    rows = table_rows(report)
    shown = [i for i in range(len(header))            # a peer's two columns only when it ran
             if i < 3 or getattr(report, PEERS[(i - 3) // 2][0]) is not None]
    header, rows = [header[i] for i in shown], [[r[i] for i in shown] for r in rows]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    def line(row):                     # trailing empty cells left out, separators and all
        cells = [str(c).ljust(w) for c, w in zip(row, widths)]
        while len(cells) > 1 and not cells[-1].strip():
            cells.pop()
        return " | ".join(cells).rstrip()
    lines = [describe(report), line(header), "-+-".join("-" * w for w in widths)] + [line(r) for r in rows]
    notes = [f"{label} {name}: {e[peer]['note']}" for peer, label in PEERS
             for name, e in report.workloads.items() if e[peer] and e[peer]["note"]]
    if report.vllm:
        notes.append(describe_vllm(report.vllm))
    return "\n".join([*lines, *notes]) + "\n"


def describe_vllm(about: dict) -> str:
    options = ", ".join(f"{k}={v}" for k, v in about["llm_options"].items())
    ready = about.get("engine_start_s")
    return (f"vLLM {about.get('vllm') or '(version n/a)'}: LLM({options}), its other settings its own "
            f"defaults" + (f"; engine ready in {ready:.0f} s" if ready is not None else ""))
