"""Where a native decode step's time goes: kernels of one eager step (torch.profiler, CUDA time per kernel
name), the step replayed as a CUDA graph alone, the same with the step compiled by torch.compile first, and the
sampling that follows each step. Prints a short table; --out appends one JSON row.

    python scripts/bench/profile_decode.py --model qwen36_mini --prompt 262144 --group 8
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from rows import emit, kernel_times, top_kernels  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from longstraw_cli.models import build_model  # noqa: E402
from longstraw_cli.models.glm52.routing import RoutingReplay  # noqa: E402
from longstraw_cli.models.spec import family_of  # noqa: E402
from longstraw_cli.rollout.native import GraphedStep  # noqa: E402
from longstraw_kernels.sampling import race_sample  # noqa: E402


def timed(fn, n: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / n


def summarise(prof, row: dict, name: str, top: int) -> None:
    """The profiled step's kernel launches and kernel time into `row`, and its `top` kernels printed."""
    kernels = kernel_times(prof)
    row[f"{name}_kernels"] = sum(count for _, count, _ in kernels)
    row[f"{name}_kernel_ms"] = 1e3 * sum(secs for _, _, secs in kernels)
    print(f"{name}: {row[f'{name}_kernels']} kernel launches, {row[f'{name}_kernel_ms']:.2f} ms of kernel time; top:")
    row[f"{name}_top"] = top_kernels(kernels, top, "ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen36_mini")
    parser.add_argument("--prompt", type=int, default=262144)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=512)
    parser.add_argument("--step", type=int, default=0,
                        help="the step the timed steps start at: a late step of a long response reads that many "
                             "response keys (at most capacity - 200: each timed call moves the step on)")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--compile-mode", default=None,
                        help="torch.compile's mode for the compiled step (the trainer's: the default), e.g. "
                             "max-autotune-no-cudagraphs (inductor tunes the matmuls of 8 rows)")
    parser.add_argument("--record-routing", action="store_true",
                        help="glm52: the steps record their routing (rollout.replay_routing's recording, the "
                             "trainer's default for glm52): run once with and once without to see what it costs")
    parser.add_argument("--top", type=int, default=10, help="kernels listed per profile")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.record_routing and family_of(args.model).routing is None:
        parser.error(f"--record-routing: {args.model} routes nothing (no MoE or DSA layers to record)")
    model = build_model(args.model, dtype=torch.bfloat16, device="cuda", seed=0)
    prompt = torch.randint(0, 250, (args.prompt,), device="cuda")
    with torch.no_grad():
        resident = model.capture(prompt, block_size=16384)
        row = {"model": args.model, "prompt": args.prompt, "group": args.group, "capacity": args.capacity,
               "step": args.step, "compile_mode": args.compile_mode, "record_routing": args.record_routing}
        recording = contextlib.nullcontext()
        if args.record_routing:
            routing = RoutingReplay(force=True)
            recording = routing.recording(routing.new_record(model, resident, args.group, args.capacity), model)
        with recording:
            profile_steps(model, resident, row, args)
    emit(row, args.out)


def new_decoder(model, resident, args):
    """A decoder at step `args.step` whose G rows decode different tokens, as a rollout's do (all rows on the
    prompt's last token would route alike: glm52_mini's 8 rows then chose 4 experts where a rollout's choose ~21,
    and the step's experts measured 0.24 ms where the trainer's took 0.54, 2026-12-04)."""
    decoder = model.decoder(resident, args.group, args.capacity)
    decoder.step_1.fill_(args.step)
    vocab = model.config.vocab_size
    decoder.tokens_B.copy_(torch.randint(0, min(vocab, 250), (args.group,), device=decoder.device,
                                         generator=torch.Generator(decoder.device).manual_seed(args.step)))
    return decoder


def profile_steps(model, resident, row: dict, args) -> None:
    """The eager step's kernels, the step as a graph, the sampling after it and (--compile) the compiled step, into
    `row`."""
    decoder = new_decoder(model, resident, args)
    decoder.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decoder.step()
        torch.cuda.synchronize()
    summarise(prof, row, "eager", args.top)

    graphed = GraphedStep(decoder)
    graphed()
    row["graph_ms"] = timed(graphed, 50)
    logits = graphed()
    g = torch.Generator("cuda").manual_seed(0)
    race = torch.empty_like(logits)
    tokens, logp, entropy = (torch.empty(args.group, dtype=t, device="cuda")
                             for t in (torch.long, logits.dtype, logits.dtype))

    # what the rollout runs after each step: the race's noise, then its sampling (the Triton kernel on CUDA;
    # kernels.sampling=torch for the reference)
    def sample():
        race_sample(logits, race.exponential_(1.0, generator=g), 1.0, 1.0, tokens, logp, entropy)

    row["sample_ms"] = timed(sample, 50)
    if args.compile:
        decoder = new_decoder(model, resident, args)
        graphed = GraphedStep(decoder, compile=True, compile_mode=args.compile_mode)
        start = time.perf_counter()
        graphed()
        torch.cuda.synchronize()
        row["compile_s"] = time.perf_counter() - start
        row["compiled_graph_ms"] = timed(graphed, 50)
        # the compiled step's kernels, launched one by one (the graph replays the same kernels)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphed.step()
            torch.cuda.synchronize()
        summarise(prof, row, "compiled", args.top)


if __name__ == "__main__":
    main()
