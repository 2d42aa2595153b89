"""Where a first launch's Triton compiles go: run a Python module as `python -m` would, with every Triton compile in
its process timed, one JSON line each to --out (kernel, its compile-time constants by name, seconds, thread, the
wall-clock time it ended), then a summary by kernel on stderr at exit.

    python scripts/bench/compile_trace.py --out compiles.jsonl -m longstraw_cli train model=glm52_mini ...

`bench_train.py --trace-compiles FILE` launches the trainer so and adds the summary to its row. A compile that hits
Triton's on-disk cache is counted too (it loads in milliseconds). Inductor's kernels are here where Inductor compiles
them in this process (glm52_mini's first launch on an H100, 2026-12-07: 27 of the 63, 5.3 of 48.0 s), not where its
worker processes do.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import runpy
import sys
import threading
import time


def install(out: str) -> None:
    """Wrap `triton.compiler.compile` (what a kernel's first launch, or `.warmup`, calls; `triton.compile` too) so
    each call appends a line to `out`. Before any kernel runs: a kernel looks the function up when it first binds to
    a device."""
    import triton
    import triton.compiler
    import triton.compiler.compiler

    real = triton.compiler.compiler.compile

    def compile(src, *args, **kwargs):
        start = time.perf_counter()
        try:
            return real(src, *args, **kwargs)
        finally:
            fn = getattr(src, "fn", None)
            names = getattr(fn, "arg_names", None) or []
            constants = getattr(src, "constants", None) or {}
            row = {"kernel": getattr(fn, "__name__", type(src).__name__),
                   "constants": {_arg_name(key, names): value for key, value in constants.items()
                                 if isinstance(value, (bool, int, float, str))},
                   "seconds": round(time.perf_counter() - start, 4), "thread": threading.get_ident(),
                   "ended": round(time.time(), 3)}
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")

    triton.compiler.compiler.compile = compile
    triton.compiler.compile = compile
    triton.compile = compile


def _arg_name(key, names: list[str]) -> str:
    """Triton keys a constant by its argument's path, (index,) for a plain argument."""
    if isinstance(key, tuple) and len(key) == 1 and isinstance(key[0], int) and key[0] < len(names):
        return names[key[0]]
    return str(key)


def summary(path: str) -> dict:
    """{"compiles", "seconds" (summed), "span_s" (first start to last end), "by_kernel": {name: [count, seconds]}}
    of a trace, kernels by seconds, most first."""
    rows = [json.loads(line) for line in open(path)]
    by = collections.defaultdict(lambda: [0, 0.0])
    for row in rows:
        by[row["kernel"]][0] += 1
        by[row["kernel"]][1] += row["seconds"]
    first = min((r["ended"] - r["seconds"] for r in rows), default=0.0)
    return {"compiles": len(rows), "seconds": round(sum(r["seconds"] for r in rows), 3),
            "span_s": round(max((r["ended"] for r in rows), default=first) - first, 3),
            "by_kernel": {name: [n, round(s, 3)] for name, (n, s) in sorted(by.items(), key=lambda kv: -kv[1][1])}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the trace, one JSON line a compile (appended to)")
    parser.add_argument("-m", dest="module", required=True, help="the module to run as __main__")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    install(args.out)

    def report():
        try:
            s = summary(args.out)
        except FileNotFoundError:
            s = {"compiles": 0, "seconds": 0.0, "by_kernel": {}}
        lines = [f"{n:3d}x {secs:7.2f} s  {name}" for name, (n, secs) in s["by_kernel"].items()]
        print(f"compile_trace: {s['compiles']} Triton compiles, {s['seconds']:.1f} s summed", *lines,
              sep="\n  ", file=sys.stderr)

    atexit.register(report)
    sys.argv = [args.module, *args.args]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
