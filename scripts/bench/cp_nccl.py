"""Context parallel over NCCL: exactness against one GPU, and capture time against one GPU.

    torchrun --nproc-per-node 2 scripts/bench/cp_nccl.py --prompt 262144

1. qwen36_tiny and glm52_tiny in fp32 on the GPUs: every rank also builds the same model without context
   parallel and computes the one-GPU answer itself; the CP model's log-probs and every parameter gradient are
   compared to it. glm52_tiny runs twice: CP alone, and CP with its routed experts split over the same ranks
   (EP: each rank's expert gradients are compared with its slice of the one-GPU gradient). Its prompt is far
   longer than index_topk, so the global top-k across shards decides the result.
2. qwen36_mini in bf16: capture of a `--prompt`-token prompt on one GPU (rank 0 alone), then over all ranks.
Prints one JSON line (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from longstraw_cli.distributed.cp import apply_context_parallel
from longstraw_cli.distributed.ep import apply_expert_parallel, expert_bounds, is_expert_param
from longstraw_cli.models import build_model


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def exactness(device, name: str = "qwen36_tiny", ep: bool = False) -> dict:
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 259, (3001,), generator=g).to(device)
    response = torch.randint(0, 259, (97,), generator=g).to(device)
    out = {}
    for case, cp in (("one_gpu", False), ("cp", True)):
        model = build_model(name, dtype=torch.float32, device=device, seed=1)
        if cp:
            apply_context_parallel(model, dist.group.WORLD)
            if ep:
                apply_expert_parallel(model, dist.group.WORLD, cp_group=dist.group.WORLD)
        resident = model.capture(prompt, block_size=512)
        logp = model.logprobs(resident, response, grad=True)
        (logp * torch.linspace(-1, 1, logp.numel(), device=device)).sum().backward()
        out[case] = (logp.detach(), {n: p.grad for n, p in model.named_parameters()}, resident.nbytes()["total"])
    one, cp = out["one_gpu"], out["cp"]
    rank, world = dist.get_rank(), dist.get_world_size()

    def reference(n):
        # an expert-parallel rank holds experts [start, end) of every routed-expert tensor
        if ep and is_expert_param(n):
            start, end = expert_bounds(one[1][n].shape[0], world, rank)
            return one[1][n][start:end]
        return one[1][n]

    names = [n for n in one[1] if one[1][n] is not None and one[1][n].norm() > 0]
    grad_err = max(rel(cp[1][n], reference(n)) for n in names)
    all_grads = rel(torch.cat([cp[1][n].flatten() for n in names]), torch.cat([reference(n).flatten() for n in names]))
    return {"logprob_max_abs_err": float((cp[0] - one[0]).abs().max()), "grad_rel_err_worst_tensor": grad_err,
            "grad_rel_err_all": all_grads, "resident_bytes_one_gpu": one[2], "resident_bytes_cp_rank": cp[2]}


def capture_seconds(model, prompt, block_size) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.capture(prompt, block_size=block_size)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prompt", type=int, default=262144)
    p.add_argument("--block-size", type=int, default=8192)
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local)
    row = {"world": world, "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}
    row["qwen36_tiny"] = exactness(device)
    row["glm52_tiny_cp"] = exactness(device, "glm52_tiny")
    row["glm52_tiny_cp_ep"] = exactness(device, "glm52_tiny", ep=True)

    model = build_model("qwen36_mini", dtype=torch.bfloat16, device=device, seed=0).requires_grad_(False)
    prompt = torch.randint(0, model.config.vocab_size, (args.prompt,), device=device,
                           generator=torch.Generator(device).manual_seed(0))
    warm = prompt[: 2 * args.block_size + 1]
    if rank == 0:
        model.capture(warm, block_size=args.block_size)
        row["capture_one_gpu_s"] = capture_seconds(model, prompt, args.block_size)
    dist.barrier()
    apply_context_parallel(model, dist.group.WORLD)
    model.capture(warm, block_size=args.block_size)
    dist.barrier()
    row["capture_cp_s"] = capture_seconds(model, prompt, args.block_size)
    row["prompt_tokens"] = args.prompt
    if rank == 0:
        row["speedup"] = row["capture_one_gpu_s"] / row["capture_cp_s"]
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
