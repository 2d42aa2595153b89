"""Where a blockwise response replay (capture.replay_block) spends its time, beside the whole-response replay.

Builds a model (random weights, LoRA optional), captures a prompt once, then times one response's replay both ways
(after a warm-up of each): the whole replay (`logprobs(grad=True)` + backward) and the blockwise one split into its
graph-free forward (`blockwise.response_forward`, keep=True, skip_last=True: all blocks but the last) and the rest
(the last block with autograd, the loss's gradient and the reverse walk over the blocks). Then one of each under
torch.profiler: the top CUDA kernels by total time.

    python scripts/bench/profile_blockwise.py --model qwen36_mini --prompt 65536 --response 1024 --block 512
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from longstraw_cli.lora import LoraConfig, apply_lora  # noqa: E402
from longstraw_cli.models import MODEL_NAMES, blockwise, build_model  # noqa: E402


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen36_mini", choices=MODEL_NAMES)
    p.add_argument("--prompt", type=int, default=65536)
    p.add_argument("--response", type=int, default=1024)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=25, help="kernels listed per profile (0: no profile)")
    args = p.parse_args()
    device = torch.device(args.device)
    model = build_model(args.model, dtype=getattr(torch, args.dtype), device=device, seed=0)
    if args.lora_rank:
        apply_lora(model, LoraConfig(rank=args.lora_rank), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt,), generator=g).to(device)
    response = torch.randint(0, vocab, (args.response,), generator=g).to(device)
    with torch.no_grad():
        resident = model.capture(prompt, block_size=8192)

    def whole():
        model.logprobs(resident, response, grad=True).float().sum().backward()

    def forward_only():
        blockwise.response_forward(model, resident, response[None], args.block, keep=True, skip_last=True)

    def blocks():
        model.replay_blocks(resident, response, lambda logp: torch.ones_like(logp), args.block)

    runs = {"whole": whole, "blockwise forward (graph-free)": forward_only, "blockwise (all)": blocks}
    for fn in runs.values():
        fn()
    for name, fn in runs.items():
        seconds = sorted(timed(fn, device) for _ in range(args.repeats))
        print(f"{name}: {1e3 * seconds[len(seconds) // 2]:.1f} ms (median of {args.repeats}; "
              f"min {1e3 * seconds[0]:.1f})", flush=True)
    model.zero_grad(set_to_none=True)
    if device.type != "cuda" or not args.top:
        return
    from torch.profiler import ProfilerActivity, profile

    for name in ("whole", "blockwise (all)"):
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            runs[name]()
            torch.cuda.synchronize()
        print(f"\n== {name}: top {args.top} by CUDA time")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=70))


if __name__ == "__main__":
    main()
