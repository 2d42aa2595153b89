"""Does GPU memory stay flat over repeated rollouts? `generate` N times from one resident state, per decode mode
(CUDA graph + torch.compile, CUDA graph, eager), printing torch.cuda.memory_allocated after each (after
gc.collect()). A trainer step's rollout is one such call; memory that grows here grows every step.

    python scripts/bench/rollout_memory.py --model qwen36_mini --prompt 16384 --tokens 64 --repeats 4
"""

from __future__ import annotations

import argparse
import gc

import torch
from rows import emit

from longstraw_cli.models import build_model
from longstraw_cli.rollout.native import NativeConfig, SamplingConfig, generate

MODES = {"graph+compile": NativeConfig(), "graph": NativeConfig(compile=False), "eager": NativeConfig(cuda_graph=False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen36_mini")
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = build_model(args.model, dtype=torch.bfloat16, device="cuda", seed=0)
    prompt = torch.randint(0, 250, (args.prompt,), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    resident = model.capture(prompt, block_size=8192)
    cfg = SamplingConfig(max_new_tokens=args.tokens)
    for mode in args.modes:
        allocated = []
        for i in range(args.repeats):
            generate(model, resident, args.group, cfg, torch.Generator("cuda").manual_seed(i), MODES[mode])
            gc.collect()
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
        growth = [b - a for a, b in zip(allocated, allocated[1:])]
        emit({"model": args.model, "prompt": args.prompt, "group": args.group, "tokens": args.tokens, "mode": mode,
              "allocated_mib": [a / 2**20 for a in allocated], "growth_per_rollout_mib": [g / 2**20 for g in growth]},
             args.out)


if __name__ == "__main__":
    main()
