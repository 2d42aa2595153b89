"""The real job, measured: `longstraw train` itself, on the GPU, with native rollout; its metrics rows are the record.

Runs `python -m longstraw_cli train <overrides> steps=N run_dir=...` once per prompt length (`--nproc N`: under
torchrun, N ranks; the worst rank's numbers) and reads back the run's metrics.jsonl: per step the time and CUDA
peak of each phase (rollout, drift, reward, capture, score, replay, finalize, step) and decode ms per token, the
host's peak RSS and, with capture.offload=cpu, the bytes of pages held in host memory; with capture.reuse_steps > 1
also each step's reuse cycle, captures and drift (`reuse`). Step 0 also pays one-time costs (Triton JIT,
cuBLAS/cuDNN handles, the first CUDA-graph capture): it is reported as its own row, `warmup`, and the later
steps are averaged into `steady`; `first_step_extra_s` is step 0's time minus the steady step's. `transaction_s`
is the step without rollout and reward, what `scripts/bench/bench_step.py` times in isolation. One JSON row per
run to --out.

`capture_tflops` is the capture's analytic FLOPs (longstraw_cli/plan/flops.py: the model named by `model=`, with
`model.override_config`, over prompt_tokens - 1 captured tokens) over the steady capture seconds, for the whole job;
`capture_utilisation` divides it by the ranks' measured bf16 matmul ceiling (rows.H200_BF16_CEILING each).
`--annotate FILE` adds both to the rows of an earlier run's jsonl and prints them (nothing is run).
`--trace-compiles FILE` runs the trainer under compile_trace.py: each Triton compile of the run timed, one line
each, and their summary in the row (`compiles`: count, seconds summed, by kernel).

    python scripts/bench/bench_train.py --prompt 65536 262144 -- model=qwen36_mini model.dtype=bfloat16 \\
        device=cuda task=passkey group_size=8 response_tokens=1024

Strong scaling (`--cp 1 2 4 8`): each prompt runs once per context-parallel size N, on N ranks with cp=N, then one
`scaling` row gives the steady capture and step times by N and their efficiency against linear, T(1) / (N T(N))
(T(1) from the smallest N run, scaled as if linear below it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import compile_trace
from rows import H200_BF16_CEILING, emit

PHASES = ("rollout", "drift", "reward", "capture", "score", "replay", "prompt", "finalize", "step")
TRANSACTION = ("capture", "drift", "score", "replay", "prompt", "finalize", "step")
GIB = 2**30


def summarize(rows: list[dict]) -> dict:
    """Step 0 as `warmup`; the mean of the later steps as `steady` (times in s, peaks in GiB)."""

    def phases(row):
        out = {p: row.get(f"time/{p}", 0.0) for p in PHASES}
        out["total"] = sum(out.values())
        out["transaction"] = sum(out[p] for p in TRANSACTION)
        out["decode_ms_per_step"] = 1e3 * row.get("time/decode_step", row.get("time/decode_per_token", float("nan")))
        out["decode_setup_s"] = row.get("time/decode_setup", float("nan"))
        out.update({f"peak_{p}_gib": row[f"mem/peak_{p}"] / GIB for p in PHASES if f"mem/peak_{p}" in row})
        return out

    later = [phases(r) for r in rows[1:]] or [phases(rows[0])]
    steady = {k: sum(p[k] for p in later) / len(later) for k in later[0]}
    summary = {"warmup": phases(rows[0]), "steady": steady,
               "first_step_extra_s": phases(rows[0])["total"] - steady["total"],
               "rollout_over_capture": steady["rollout"] / max(steady["capture"], 1e-9),
               "step_over_transaction": steady["total"] / max(steady["transaction"], 1e-9),
               "ratio_mean_step0": rows[0].get("ratio_mean"), "decode_steps": rows[-1].get("decode_steps")}
    if "reuse_cycle" in rows[0]:
        # capture.reuse_steps > 1: the steady mean holds one capture per K steps when steps - 1 is a multiple of K
        summary["reuse"] = [{k: r[k] for k in ("step", "reuse_cycle", "captures", "drift", "drift_mean")}
                            for r in rows]
    peaks = [v for k, v in steady.items() if k.startswith("peak_")]
    summary["peak_gib"] = max(peaks) if peaks else None
    # host side: the process's peak resident set (pinned pages of capture.offload=cpu count there once written)
    # and the bytes of pages the last step kept in host memory (0 without offload)
    summary["host_rss_peak_gib"] = rows[-1].get("mem/rss_peak", 0) / GIB
    summary["host_pages_gib"] = rows[-1].get("mem/host_pages", 0) / GIB
    return summary


def scaling(prompt: int, runs: dict[int, dict]) -> dict:
    """The `scaling` row of one prompt from its runs by cp: steady capture and step seconds, and efficiency against
    linear from the smallest cp's time (1.0 there)."""
    done = {n: r for n, r in sorted(runs.items()) if "steady" in r}
    row = {"scaling": True, "prompt": prompt, "cp": list(done)}
    if not done:
        return row
    base = min(done)
    for key, phase in (("capture_s", "capture"), ("step_s", "total")):
        times = [done[n]["steady"][phase] for n in done]
        row[key] = times
        row[key.replace("_s", "_efficiency")] = [times[0] * base / (n * t) if t > 0 else None
                                                 for n, t in zip(done, times)]
    row["peak_gib"] = [done[n]["peak_gib"] for n in done]
    return row


def capture_rate(command: str, prompt: int, seconds: float, ranks: int = 1) -> dict:
    """capture_flops (the analytic count by term), capture_tflops and capture_utilisation of a run's steady capture
    from its `longstraw train` overrides; {} when they name no model (a model.path checkpoint, the default model)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from longstraw_cli.models import family_of
    from longstraw_cli.plan.flops import capture_flops

    words = command.split()
    overrides = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(
        [w for w in words if "=" in w and not w.startswith("-")])}
    if "model" not in overrides or seconds <= 0:
        return {}
    name, shape = overrides["model"], overrides.get("model.override_config") or {}
    cfg = family_of(name).named_config(name, **shape)
    flops = capture_flops(cfg, prompt - 1)
    return {"capture_flops": flops, "capture_tflops": flops["total"] / seconds / 1e12,
            "capture_utilisation": flops["total"] / seconds / (ranks * H200_BF16_CEILING)}


def annotate(path: str) -> None:
    """Each row of an earlier bench_train jsonl with capture_rate added, printed."""
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if "steady" in row:
            words = row["command"].split()
            ranks = int(words[words.index("--nproc-per-node") + 1]) if "--nproc-per-node" in words else 1
            row.update(capture_rate(row["command"], row["prompt"], row["steady"]["capture"], ranks))
        emit(row, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, nargs="+")
    parser.add_argument("--annotate", metavar="FILE", help="add capture_tflops / capture_utilisation to a jsonl's rows")
    parser.add_argument("--steps", type=int, default=3, help="steps per run (step 0 is the warm-up)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--run-root", default=None,
                        help="where the runs' dirs go (default: a temporary dir); on the device machine $OUT/runs "
                             "brings each step's metrics.jsonl back even when the call's time limit kills the run")
    parser.add_argument("--nproc", type=int, default=1,
                        help="ranks: > 1 launches the run under torchrun (--standalone) with this many processes, "
                             "e.g. with cp=8; its metrics.jsonl holds the worst rank's times and peaks")
    parser.add_argument("--cp", type=int, nargs="+", default=None,
                        help="strong scaling: run each prompt at each of these cp sizes (on that many ranks; "
                             "replaces --nproc), then a `scaling` row of efficiency against linear")
    parser.add_argument("--trace-compiles", metavar="FILE", default=None,
                        help="time every Triton compile of each run (compile_trace.py), one JSON line each to FILE "
                             "with the prompt length before its suffix; the row gets their summary (one rank)")
    parser.add_argument("overrides", nargs="*", help="longstraw train overrides (after --)")
    args = parser.parse_args()
    if args.annotate:
        return annotate(args.annotate)
    if not args.prompt:
        parser.error("--prompt is required (or --annotate FILE)")
    if args.cp and args.nproc != 1:
        parser.error("--cp sets the ranks of each run (cp=N on N ranks); leave out --nproc")
    if args.trace_compiles and (args.nproc != 1 or args.cp):
        parser.error("--trace-compiles times one process's compiles: leave out --nproc and --cp")
    for prompt in args.prompt:
        runs = {}
        for cp in args.cp or [None]:
            nproc = cp or args.nproc
            runs[cp] = run(prompt, nproc, [*args.overrides, *([f"cp={cp}"] if cp else [])], args)
        if args.cp:
            emit(scaling(prompt, runs), args.out)


def run(prompt: int, nproc: int, overrides: list[str], args) -> dict:
    """One `longstraw train` run on nproc ranks; its row, emitted."""
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    trace = None
    if args.trace_compiles:
        trace = Path(args.trace_compiles)
        trace = trace.with_name(f"{trace.stem}-{prompt}{trace.suffix}")
        trace.unlink(missing_ok=True)
        launcher = [sys.executable, str(Path(__file__).with_name("compile_trace.py")), "--out", str(trace)]
    if args.run_root:
        Path(args.run_root).mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="bench_train_", dir=args.run_root))
    cmd = [*launcher, "-m", "longstraw_cli", "train", *overrides, f"prompt_tokens={prompt}",
           f"steps={args.steps}", f"run_dir={run_dir}", "checkpoint.enabled=false"]
    start = time.perf_counter()
    done = subprocess.run(cmd, env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    row = {"date": datetime.date.today().isoformat(), "command": " ".join(cmd[1:]), "prompt": prompt,
           "returncode": done.returncode, "wall_s": time.perf_counter() - start}
    metrics = run_dir / "metrics.jsonl"
    if done.returncode == 0 and metrics.exists():
        row.update(summarize([json.loads(line) for line in metrics.read_text().splitlines()]))
        row.update(capture_rate(row["command"], prompt, row["steady"]["capture"], nproc))
    if trace is not None and trace.exists():
        row["compiles"] = {"trace": str(trace), **compile_trace.summary(str(trace))}
    emit(row, args.out)
    return row


if __name__ == "__main__":
    main()
