"""Prompt capture against an unchunked no-grad forward of the same prompt, and capture's FLOP utilisation.

For each prompt length P, on the same model (random weights), one process:
  capture        `model.capture`: block by block (all layers per block), keeping the resident state;
  capture_span   `model.capture_span` over the whole prompt: layer by layer (what context parallel runs per rank);
  forward        the plain full-sequence forward under no_grad (causal SDPA over the whole prompt, GDN from a
                 zero state, MLP unchunked), final norm included, no logits: the same work minus the paging.
FLOPs: the analytic capture count of longstraw_cli/plan/flops.py (`capture_flops`: linear layers, causal attention,
GDN's chunked products and conv for qwen36; MLA, the DSA indexer and the experts for glm52), by term. Rows before
2026-12 counted linear + attention only (GDN's chunks and conv are 0.3% of qwen36_mini's at 256K). The ceiling is a
measured large bf16 matmul on this GPU (and the H200's dense bf16 spec, 989 TFLOP/s, for reference). One JSON row
per P to --out. With --top N, one more capture per P runs under torch.profiler: its N longest CUDA kernels, and
the wall time against the kernels' total (the gap is the host: launches, synchronisations). With --kernels
CHANGES (`kernels.` fields, e.g. norm=torch), `model.capture` then runs --repeats more times under the default choices
and as many under CHANGES, alternated (A B B A ...: a GPU's clock drifts over a run), into the row's `alternated`:

    python scripts/bench/bench_capture.py --model glm52_mini --prompts 262144 --block-size 4096 --methods capture \
        --kernels norm=torch --repeats 3

With --syncs, one more capture per P counts its host synchronisations (`torch.cuda.set_sync_debug_mode`), by the
line of longstraw's code that made them, into the row's `syncs`: each one empties the GPU's queue of kernels.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import traceback
import warnings

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from rows import kernel_times, kernel_variant, top_kernels  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from longstraw_cli.models import MODEL_NAMES, build_model  # noqa: E402
from longstraw_cli.plan.flops import capture_flops  # noqa: E402
from longstraw_kernels.attention.flash import forward_backend  # noqa: E402

SPEC_BF16_FLOPS = 989e12  # H200 SXM dense bf16


def timed(fn, repeats: int = 1) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def matmul_ceiling(n: int = 8192, repeats: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    timed(lambda: a @ b, 3)
    return 2 * n**3 / timed(lambda: a @ b, repeats)


@torch.no_grad()
def unchunked_forward(model, ids_T):
    positions_T = torch.arange(ids_T.numel(), device=ids_T.device)
    x_BTC = model.model.embed_tokens(ids_T)[None]
    for layer in model.model.layers:
        x_BTC, _ = layer(x_BTC, positions_T)
    return model.model.norm(x_BTC)


def profiled_capture(run, top: int) -> dict:
    prof = profile(activities=[ProfilerActivity.CUDA])
    with prof:
        seconds = timed(run)
    kernels = kernel_times(prof)
    out = {"seconds": seconds, "kernel_s": sum(secs for _, _, secs in kernels)}
    print(f"capture under the profiler {seconds:.2f} s, kernel time {out['kernel_s']:.2f} s; longest kernels:")
    out["top"] = top_kernels(kernels, top)
    return out


# the packages whose frames name a synchronisation's site
PACKAGES = ("longstraw_cli", "longstraw_kernels")
# what torch warns (c10's warn_or_error_on_sync) for each synchronising call under set_sync_debug_mode("warn")
SYNC_WARNING = "called a synchronizing CUDA operation"


def counted_syncs(run, top: int = 12) -> dict:
    """One `run` under torch.cuda.set_sync_debug_mode("warn"), where each CUDA call that synchronises with the host
    warns: -> {"total": n, "sites": {"file:line code": count}} (the `top` most frequent), a site being the innermost
    frame of longstraw's packages in the warning's stack (else the warning's own location). Other warnings of the
    run are shown as they would be, not counted."""
    sites: collections.Counter[str] = collections.Counter()
    show = warnings.showwarning

    def note(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            show(message, category, filename, lineno, file, line)
            return
        ours = [f for f in traceback.extract_stack() if any(f"{os.sep}{pkg}{os.sep}" in f.filename for pkg in PACKAGES)]
        if ours:
            sites[f"{os.path.basename(ours[-1].filename)}:{ours[-1].lineno} {ours[-1].line or ''}".strip()] += 1
        else:
            sites[f"{os.path.basename(filename)}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return {"total": sum(sites.values()), "sites": dict(sites.most_common(top))}


def alternated(run, kernels: str, repeats: int) -> dict[str, list[float]]:
    """Seconds of `run` under the default kernels' choices and under `kernels` (rows.kernel_variant's form),
    `repeats` each, in the order A B B A A B ...; a choice's first run may pay compiles the warm-up did not (read the
    later ones)."""
    times: dict[str, list[float]] = {"default": [], kernels: []}
    for i in range(repeats):
        for label in ("default", kernels) if i % 2 == 0 else (kernels, "default"):
            with kernel_variant("" if label == "default" else kernels):
                times[label].append(timed(run))
            print(f"  {label}: {times[label][-1]:.3f} s", flush=True)
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen36_mini", choices=MODEL_NAMES)
    p.add_argument("--prompts", default="65536,262144")
    p.add_argument("--block-size", type=int, default=8192)
    p.add_argument("--methods", default="capture,capture_span,forward")
    p.add_argument("--out", default="capture.jsonl")
    p.add_argument("--top", type=int, default=0, help="profile one more capture per P: its N longest kernels")
    p.add_argument("--kernels", default="", help="kernels' choices to time the capture against the default's, "
                                                 "e.g. norm=torch or kernels.norm=torch,gdn=torch")
    p.add_argument("--repeats", type=int, default=3, help="captures under each of default and --kernels")
    p.add_argument("--syncs", action="store_true", help="count one more capture's host synchronisations by site")
    args = p.parse_args(argv)
    if args.kernels:
        try:  # a bad field or choice now, not after the model is built and the first captures ran
            with kernel_variant(args.kernels):
                pass
        except ValueError as exc:
            p.error(f"--kernels: {exc}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_capture needs CUDA")
    model = build_model(args.model, dtype=torch.bfloat16, device="cuda", seed=0).requires_grad_(False)
    ceiling = matmul_ceiling()
    print(f"bf16 matmul ceiling {ceiling / 1e12:.0f} TFLOP/s; attention kernel {forward_backend()}", flush=True)
    # compile and autotune every kernel (fla's Triton kernels among them) before anything is timed: the captures
    # over eight blocks (or the shortest prompt), not 8,192 tokens, as some kernels take only long rows (glm52's
    # threshold select, rows of >= 16,384 keys; the first capture to reach them paid their compiles: 9.55 s for a
    # 1.17 s capture at 64K on an H100, 2026-12-06), then what each prompt's capture compiles ahead
    # (`prepare_capture`: glm52's select at each chunk size; without it, on an H100, 2026-12-07, 13.79 s for a
    # first timed capture at 256K against 6.69 for the next, profiled one); the unchunked forward over 8,192 (its
    # scores are whole)
    prompts = [int(x) for x in args.prompts.split(",")]
    warm = torch.randint(0, model.config.vocab_size, (min(min(prompts), 8 * args.block_size) + 1,), device="cuda")
    methods = args.methods.split(",")
    if "capture" in methods or args.top:
        model.capture(warm, block_size=args.block_size)
    for P in prompts:
        model.prepare_capture(P)
    if "capture_span" in methods:
        model.capture_span(warm[:-1], start=0, num_tokens=warm.numel() - 1, last_token=0, block_size=args.block_size)
    if "forward" in methods:
        unchunked_forward(model, warm[:8192])
    for P in prompts:
        ids = torch.randint(0, model.config.vocab_size, (P + 1,), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(P))
        flops = capture_flops(model, P)
        row = {"model": args.model, "prompt_tokens": P, "block_size": args.block_size, "ceiling_flops": ceiling,
               "attention_kernel": forward_backend(), "flops": flops, "gpu": torch.cuda.get_device_name()}
        runs = {
            "capture": lambda ids=ids: model.capture(ids, block_size=args.block_size),
            "capture_span": lambda ids=ids, P=P: model.capture_span(ids[:-1], start=0, num_tokens=P,
                                                                    last_token=int(ids[-1]),
                                                                    block_size=args.block_size),
            "forward": lambda ids=ids: unchunked_forward(model, ids[:-1]),
        }
        for name in methods:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            try:
                seconds = timed(runs[name])
            except torch.cuda.OutOfMemoryError:
                row[name] = {"status": "OOM"}
                continue
            total = flops["total"]
            row[name] = {"seconds": seconds, "peak_extra_bytes": torch.cuda.max_memory_allocated() - base,
                         "tflops": total / seconds / 1e12, "of_ceiling": total / seconds / ceiling,
                         "of_spec": total / seconds / SPEC_BF16_FLOPS}
            print(f"P={P} {name}: {seconds:.2f} s, {row[name]['tflops']:.0f} TFLOP/s "
                  f"({100 * row[name]['of_ceiling']:.0f}% of measured ceiling), "
                  f"+{row[name]['peak_extra_bytes'] / 2**30:.2f} GiB", flush=True)
        if "capture" in row and "forward" in row and "seconds" in row["forward"] and "seconds" in row["capture"]:
            row["capture_over_forward"] = row["capture"]["seconds"] / row["forward"]["seconds"]
            print(f"P={P} capture / forward = {row['capture_over_forward']:.3f}", flush=True)
        if args.top:
            row["profile"] = profiled_capture(runs["capture"], args.top)
        if args.kernels:
            row["alternated"] = alternated(runs["capture"], args.kernels, args.repeats)
        if args.syncs:
            row["syncs"] = counted_syncs(runs["capture"])
            print(f"P={P} host synchronisations in one capture: {row['syncs']['total']}", flush=True)
            for site, n in row["syncs"]["sites"].items():
                print(f"  {n:6d}  {site}", flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
