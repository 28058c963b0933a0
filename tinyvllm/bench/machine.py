"""What a bench report says about where it ran: the device (for a GPU its name and its measured
device-to-device copy bandwidth, from which the report's bandwidth floor follows) and the
checkout's git commit.
"""
from __future__ import annotations

import platform
import statistics
import subprocess
from pathlib import Path


def measure_copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 5) -> float:
    """Device-to-device memcpy bandwidth in bytes/s, read + write counted: the most bytes per
    second any kernel can stream. Median of `repeats` timed copies after one warm-up copy."""
    import pycuda.driver as drv
    drv.init()
    ctx = drv.Device(0).retain_primary_context()    # the context the engine uses too
    ctx.push()
    try:
        src, dst = drv.mem_alloc(nbytes), drv.mem_alloc(nbytes)
        stream, start, end = drv.Stream(), drv.Event(), drv.Event()
        seconds = []
        for i in range(repeats + 1):
            start.record(stream)
            drv.memcpy_dtod_async(dst, src, nbytes, stream)
            end.record(stream)
            end.synchronize()
            if i:
                seconds.append(end.time_since(start) / 1e3)
        src.free()
        dst.free()
    finally:
        ctx.pop()
    return 2 * nbytes / statistics.median(seconds)


def git_commit() -> str | None:
    """The checkout's commit, with "-dirty" when the working tree has changes; None outside git."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40"],
                             cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def device_info(device: str) -> dict:
    """The report's "device": kind, name and (cuda) measured copy bandwidth in GB/s."""
    if device == "cpu":
        return {"kind": "cpu", "name": f"cpu ({platform.processor() or platform.machine()}, numpy "
                                      f"reference backend)", "copy_bandwidth_GBps": None}
    import pycuda.driver as drv
    drv.init()
    return {"kind": "cuda", "name": drv.Device(0).name(),
            "copy_bandwidth_GBps": measure_copy_bandwidth() / 1e9}
