"""The benchmarks' shared helpers: one JSON row per measurement, printed (the device call's output carries the end
of it) and appended to --out; a CUDA-event timer; a profile's kernels."""

from __future__ import annotations

import json
import statistics

# the bf16 matmul ceiling measured on one H200 (an 8192^3 matmul, scripts/bench/bench_capture.py's
# `matmul_ceiling`): 798.3 TFLOP/s, docs/bench/h200-capture-2026-11-29.jsonl `ceiling_flops`, docs/BENCHMARKS.md
# "Capture against an unchunked forward"; the dense bf16 spec is 989
H200_BF16_CEILING = 798.3e12


def emit(row: dict, out: str | None) -> None:
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def kernel_times(prof) -> list[tuple[str, int, float]]:
    """The CUDA kernels a finished torch.profiler run saw: (name, launches, seconds of device time), longest first."""
    events = [(e.key, e.count, e.device_time_total / 1e6) for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(events, key=lambda e: -e[2])


def top_kernels(kernels: list[tuple[str, int, float]], top: int, unit: str = "s") -> list[list]:
    """The `top` longest of `kernel_times` as JSON rows [name (140 characters at most), launches, time in `unit`
    ("s" or "ms")], each printed."""
    scale = {"s": 1.0, "ms": 1e3}[unit]
    rows = [[key[:140], count, scale * secs] for key, count, secs in kernels[:top]]
    for name, count, t in rows:
        print(f"  {t:8.3f} {unit:>2} {count:6d}x  {name}", flush=True)
    return rows


def kernel_variant(variant: str):
    """The kernel choices of `variant`, ','-separated op=choice (`kernels.` optional: `kernels.router=torch`; "" is
    the defaults), as a context manager: in force inside the block. A bad op or choice is the config's own
    ConfigError (a ValueError), as is an item without "="."""
    from longstraw_cli.config import ConfigError, _kernels
    from longstraw_kernels import use_kernels

    items = [item for item in variant.split(",") if item]
    if any("=" not in item for item in items):
        raise ConfigError(f"kernel choices {variant!r}: each item op=choice, e.g. kernels.norm=torch")
    choices = dict(item.removeprefix("kernels.").split("=", 1) for item in items)
    # true / false as the command line reads them; the rest checked by the config's own parse of the section
    flags = {"true": True, "false": False}
    return use_kernels(_kernels({op: flags.get(value, value) for op, value in choices.items()}))


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


def graph_ms(fn, repeats: int = 100):
    """(fn()'s output, the mean ms of one replay of a CUDA graph of fn, over `repeats` replays), after three warm-up
    calls (compilation, lazy allocations) and the capture: how a decode step's pieces run."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out, time_ms(lambda: [graph.replay() for _ in range(repeats)], 1, warmup=0) / repeats


def peak_gib(fn) -> float:
    """GiB that fn adds to the allocated CUDA memory at its peak."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def rel(a, b) -> float:
    """|a - b| / |b| in fp64 (Frobenius norms)."""
    return float((a.double() - b.double()).norm() / b.double().norm())
