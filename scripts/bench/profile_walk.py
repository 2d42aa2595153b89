"""Where exact mode's reverse walk over the prompt (`capture.gradient=exact`) spends its time, beside the capture.

Builds a model (random weights; full fine-tuning, or LoRA with --lora-rank), captures a prompt with block
boundaries, fills the resident state's gradient with random values (what the replays would have sent into it: the
walk's kernels and their time do not depend on the values), then times the walk (`prompt_backward`) against the
capture (each after a warm-up run of both at a short prompt, so that the Triton JIT is not counted), and profiles
one walk under torch.profiler: the top CUDA kernels by total time, and the time per kernel family.

    python scripts/bench/profile_walk.py --model qwen36_mini --prompt 262144
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from profile_blockwise import timed  # noqa: E402
from rows import emit, kernel_times, top_kernels  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from longstraw_cli.lora import LoraConfig, apply_lora  # noqa: E402
from longstraw_cli.models import MODEL_NAMES, build_model  # noqa: E402
from longstraw_cli.resident.gradient import StateGrad  # noqa: E402

CUDA = torch.device("cuda")
# kernel-name fragments -> family, first match wins (names as CUDA reports them)
FAMILIES = (("flash", "attention (flash)"), ("fmha", "attention (flash)"), ("attn", "attention (other)"),
            ("chunk", "gdn"), ("gdn", "gdn"), ("recurrent", "gdn"), ("gemm", "matmul"), ("cutlass", "matmul"),
            ("sm90", "matmul"), ("nvjet", "matmul"), ("conv", "conv"), ("reduce", "reduction"),
            ("elementwise", "elementwise"), ("copy", "copy"), ("triton", "triton (other)"))


def family(name: str) -> str:
    low = name.lower()
    return next((fam for key, fam in FAMILIES if key in low), "other")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen36_mini", choices=MODEL_NAMES)
    p.add_argument("--prompt", type=int, default=262144)
    p.add_argument("--block", type=int, default=4096)
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--checkpoint-layers", action="store_true", help="capture.walk_checkpoint=true")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = build_model(args.model, dtype=torch.bfloat16, device="cuda", seed=0)
    if args.lora_rank:
        apply_lora(model, LoraConfig(rank=args.lora_rank), dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def run(length: int, prof=None) -> dict:
        prompt = torch.randint(0, vocab, (length,), generator=gen).cuda()
        holder = {}

        def capture():
            with torch.no_grad():
                holder["resident"] = model.capture(prompt, block_size=args.block, boundaries=True)

        t_capture = timed(capture, CUDA)
        resident = holder.pop("resident")
        grad = StateGrad(resident)
        for layer in grad.layers:
            for t in layer.values():
                t.normal_(0.0, 1e-3)
        walk = lambda: model.prompt_backward(prompt, resident, grad, args.block,  # noqa: E731
                                             args.checkpoint_layers)
        if prof is None:
            t_walk = timed(walk, CUDA)
        else:
            with prof:
                t_walk = timed(walk, CUDA)
        model.zero_grad(set_to_none=True)
        return {"capture_s": t_capture, "walk_s": t_walk, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}

    run(2 * args.block)  # warm-up: Triton JIT and autotuning of every kernel the walk and the capture use
    torch.cuda.reset_peak_memory_stats()
    row = {"model": args.model, "prompt": args.prompt, "block": args.block, "lora_rank": args.lora_rank,
           "checkpoint_layers": args.checkpoint_layers, **run(args.prompt)}
    row["walk_over_capture"] = row["walk_s"] / row["capture_s"]
    print(f"capture {row['capture_s']:.2f} s, walk {row['walk_s']:.2f} s ({row['walk_over_capture']:.2f}x), "
          f"peak {row['peak_gib']:.1f} GiB", flush=True)
    if args.top:
        prof = profile(activities=[ProfilerActivity.CUDA])
        profiled = run(args.prompt, prof)
        kernels = kernel_times(prof)
        row["profiled_walk_s"], row["kernel_s"] = profiled["walk_s"], sum(secs for _, _, secs in kernels)
        families: dict[str, float] = {}
        for key, _, secs in kernels:
            families[family(key)] = families.get(family(key), 0.0) + secs
        row["families_s"] = dict(sorted(families.items(), key=lambda kv: -kv[1]))
        print(f"walk under the profiler {profiled['walk_s']:.2f} s, kernel time {row['kernel_s']:.2f} s; by family:")
        for name, secs in row["families_s"].items():
            print(f"  {secs:8.3f} s  {name}")
        row["top"] = top_kernels(kernels, args.top)
    emit(row, args.out)

if __name__ == "__main__":
    main()
