"""The native rollout as the trainer runs it (`rollout.native.generate`: compiled step, CUDA graph, sampling, stop
checks), on a task's prompt or random tokens, with and without routing replay's recording (glm52; each record
released before the next rollout, as the trainer does): a decode step's time less the rollout's setup, the
record's offload, and the rollout's kernels a step (torch.profiler: launches and device time a step, the longest
kernels). `profile_decode.py` profiles one step alone; this is the loop around it.

    python scripts/bench/profile_rollout.py --model glm52_mini --prompt 262144 --group 8 --tokens 1024
    python scripts/bench/profile_rollout.py --prompts passkey --record on --no-profile \
        --variants ";kernels.router=torch;kernels.decode_linear=torch"
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from rows import emit, kernel_times, kernel_variant, top_kernels  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from longstraw_cli.models import build_model  # noqa: E402
from longstraw_cli.models.spec import family_of  # noqa: E402
from longstraw_cli.rl.task_base import TaskConfig  # noqa: E402
from longstraw_cli.rl.tasks import make_task  # noqa: E402
from longstraw_cli.rollout import native  # noqa: E402
from longstraw_cli.tokenizer import ByteTokenizer  # noqa: E402


def prompt_ids(kind: str, tokens: int, response: int) -> torch.Tensor:
    """A task's first prompt (byte tokens, `tokens - response` long as the trainer asks for), or random bytes of
    that length (bench_decode.py's prompt)."""
    if kind == "random":
        return torch.randint(0, 250, (tokens - response,), generator=torch.Generator().manual_seed(tokens))
    tokenizer = ByteTokenizer()
    task = make_task(TaskConfig(name=kind, prompt_tokens=tokens - response), tokenizer)
    return torch.tensor(tokenizer.encode(task.prompt_text(task.example(0))))


def measure(model, resident, args, routing) -> dict:
    """A decode step: the rollout less its setup, the offload included (as the trainer's time/decode_step), over
    --repeats rollouts after one to warm up; the offload alone, a rollout; the kernels a step (--profile)."""
    sampling, generator = native.SamplingConfig(max_new_tokens=args.tokens), torch.Generator("cuda").manual_seed(0)
    offload = [0.0]
    if routing is not None:
        plain_offload = routing.offload

        def timed_offload(*a, **k):
            start = time.perf_counter()
            out = plain_offload(*a, **k)
            offload[0] += time.perf_counter() - start
            return out

        routing.offload = timed_offload

    def rollout():
        out = native.generate(model, resident, args.group, sampling, generator,
                              native.NativeConfig(), routing=routing)
        if routing is not None:
            routing.release(out.routing)
        return out

    rollout()
    offload[0], total, setup, steps = 0.0, 0.0, 0.0, 0
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = rollout()
        torch.cuda.synchronize()
        total += time.perf_counter() - start
        setup += out.setup_s
        steps += out.decode_steps
    row = {"step_ms": 1e3 * (total - setup) / steps, "setup_s": setup / args.repeats,
           "offload_s": offload[0] / args.repeats, "steps": steps // args.repeats}
    if args.profile:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = rollout()
            torch.cuda.synchronize()
        n = out.decode_steps
        # launches over the rollout (top_kernels prints them as ints), device time a step
        kernels = [(name, count, secs / n) for name, count, secs in kernel_times(prof)]
        row["launches_per_step"] = sum(k[1] for k in kernels) / n
        row["kernel_ms_per_step"] = 1e3 * sum(k[2] for k in kernels)
        print(f"{row['launches_per_step']:.1f} launches, {row['kernel_ms_per_step']:.3f} ms of kernels a step; "
              f"the longest (ms a step, launches in the rollout):", flush=True)
        row["top"] = top_kernels(kernels, args.top, "ms")
    return row


@torch.no_grad()
def setup_parts(model, resident, args) -> dict:
    """A rollout's setup taken apart, each part synchronised (no routing record; after `measure`, so nothing
    compiles): building the decoder (buffers, state and weight copies), its step once through the compiled
    function, eagerly, and the rollout's first step on a second decoder (that step on a side stream, then the
    CUDA graph's capture and instantiation)."""
    def timed(fn):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, time.perf_counter() - start

    def build():
        return model.decoder(resident, args.group, args.tokens)

    decoder, build_s = timed(build)
    _, step_s = timed(decoder.compiled() if decoder.compile_safe else decoder.step)
    del decoder
    decoder, _ = timed(build)
    _, first_s = timed(native.GraphedStep(decoder, compile=decoder.compile_safe))
    return {"setup_build_s": build_s, "setup_eager_step_s": step_s, "setup_graphed_first_s": first_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="glm52_mini")
    parser.add_argument("--prompt", type=int, default=262144, help="prompt + response tokens, as the trainer's")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024, help="response tokens (no stop token: all decoded)")
    parser.add_argument("--prompts", default="passkey,random", help="task names and/or 'random'")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--record", default="off,on", help="routing replay's recording: off and/or on (MoE)")
    parser.add_argument("--variants", default="",
                        help="';'-separated kernel choices to compare in this process, each ','-separated "
                             "kernels.OP=CHOICE (empty: the defaults), e.g. ';kernels.router=torch'")
    parser.add_argument("--setup-parts", action="store_true",
                        help="also time the rollout's setup apart: the decoder's build, an eager step, the first "
                             "graphed step (warm-up and capture)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = build_model(args.model, dtype=torch.bfloat16, device="cuda", seed=0)
    routes = family_of(model).routing_replay("auto") is not None
    for kind in args.prompts.split(","):
        resident = model.capture(prompt_ids(kind, args.prompt, args.tokens).cuda(), block_size=16384)
        records = [value == "on" for value in args.record.split(",")] if routes else [False]
        for variant, record in itertools.product(args.variants.split(";"), records):
            # a fresh replay a measurement (its offload is timed by wrapping it); dynamo's graphs dropped: a choice
            # the step's layer function reads (a decoder attribute dynamo guards on) compiles graphs of its own, and
            # past dynamo's recompile limit (8 a function) a variant would run its layers uncompiled, silently
            routing = family_of(model).routing_replay("auto") if record else None
            torch._dynamo.reset()
            # in force for the whole rollout: a decoder reads the choices as it is built and its graph captured
            with kernel_variant(variant):
                row = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                       "model": args.model, "prompt": args.prompt, "prompt_kind": kind, "group": args.group,
                       "tokens": args.tokens, "variant": variant, "record_routing": routing is not None,
                       **measure(model, resident, args, routing)}
                if args.setup_parts:
                    row.update(setup_parts(model, resident, args))
            emit(row, args.out)
        del resident
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
