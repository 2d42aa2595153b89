"""Native decode under context parallel over NCCL, against one GPU: the same tokens, and its time per step.

    torchrun --nproc-per-node 2 scripts/bench/cp_decode_nccl.py --prompt 65536

Every rank builds the same qwen36_mini of reduced depth twice (same seed): one decodes alone from the whole
prompt's pages, the other under context parallel from its shard, the partials merged across ranks inside the
CUDA graph. 1. fp32: greedy tokens must be the one-GPU tokens and the rollout log-probs equal up to fp32 rounding.
2. bf16 at --prompt tokens: ms per decode step (G responses, the graph without torch.compile) on one GPU and
under CP. Prints one JSON line (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from longstraw_cli.distributed.cp import apply_context_parallel
from longstraw_cli.models import build_model
from longstraw_cli.rollout.native import NativeConfig, SamplingConfig, generate

LAYERS = 8
NATIVE = NativeConfig(cuda_graph=True, compile=False)


def rollout(model, prompt, group: int, tokens: int, cp: bool):
    if cp:
        apply_context_parallel(model, dist.group.WORLD)
    resident = model.capture(prompt, block_size=8192)
    cfg = SamplingConfig(temperature=0, max_new_tokens=tokens)
    generate(model, resident, group, cfg, native=NATIVE)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = generate(model, resident, group, cfg, native=NATIVE)
    torch.cuda.synchronize()
    return out, 1e3 * (time.perf_counter() - start) / out.decode_steps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prompt", type=int, default=65536)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local)
    row = {"world": dist.get_world_size(), "gpu": torch.cuda.get_device_name(device), "layers": LAYERS}

    prompt = torch.randint(0, 250, (4097,), generator=torch.Generator().manual_seed(0)).to(device)
    runs = {cp: rollout(build_model("qwen36_mini", device=device, seed=0, num_hidden_layers=LAYERS), prompt, 4, 32,
                        cp) for cp in (False, True)}
    (one, _), (cp, _) = runs[False], runs[True]
    row["fp32_tokens_equal"] = all(torch.equal(a, b) for a, b in zip(one.responses, cp.responses))
    row["fp32_logprob_max_abs_err"] = max(float((a - b).abs().max()) for a, b in zip(one.logprobs, cp.logprobs))

    prompt = torch.randint(0, 250, (args.prompt,), generator=torch.Generator().manual_seed(1)).to(device)
    for cp in (False, True):
        model = build_model("qwen36_mini", dtype=torch.bfloat16, device=device, seed=0, num_hidden_layers=LAYERS)
        _, row["decode_ms_cp" if cp else "decode_ms_one_gpu"] = rollout(model, prompt, args.group, args.tokens, cp)
        del model
        torch.cuda.empty_cache()
    row.update(prompt_tokens=args.prompt, group=args.group)
    row["cp_over_one_gpu"] = row["decode_ms_cp"] / row["decode_ms_one_gpu"]
    if dist.get_rank() == 0:
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
