"""The benchmarks' shared helpers: one JSON row per measurement, printed (the device call's output carries the end
of it) and appended to --out; and a CUDA-event timer."""

from __future__ import annotations

import json
import statistics


def emit(row: dict, out: str | None) -> None:
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def time_ms(fn, repeats: int, warmup: int = 1) -> float:
    """Median ms of fn() on the GPU (CUDA events, synchronised) over `repeats` calls, after `warmup` calls."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
