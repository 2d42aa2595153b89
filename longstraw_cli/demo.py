"""The embedded default until the trainer lands: a few GRPO transactions on qwen36_tiny, CPU, one process.

Each iteration: make a synthetic long prompt, capture it once, roll G responses out of that resident state,
reward them, then score / replay one response at a time / finalize / step, and print what was measured.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console

from longstraw_cli.models import build_model
from longstraw_cli.rl.losses import LossConfig
from longstraw_cli.rl.rewards import get_reward
from longstraw_cli.rl.tasks import TaskConfig, make_task
from longstraw_cli.rollout.native import SamplingConfig, generate
from longstraw_cli.tokenizer import ByteTokenizer
from longstraw_cli.transaction import Transaction, TransactionConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="longstraw demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--response-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.group_size < 2:
        parser.error(f"--group-size must be >= 2, got {args.group_size}")

    console = Console()
    torch.manual_seed(args.seed)
    tokenizer = ByteTokenizer()
    task = make_task(TaskConfig(name="char_choice", prompt_tokens=args.prompt_tokens, seed=args.seed), tokenizer)
    reward_fn = get_reward("char_rate")
    model = build_model("qwen36_tiny", seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tx = Transaction(model, optimizer, LossConfig(name="grpo"), TransactionConfig(block_size=args.block_size))
    sampling = SamplingConfig(max_new_tokens=args.response_tokens, stop_token_ids=(tokenizer.eos_token_id,))
    generator = torch.Generator().manual_seed(args.seed)

    console.print(f"[bold]longstraw demo[/]: qwen36_tiny, task char_choice, prompt {args.prompt_tokens} tokens, "
                  f"G={args.group_size}, {args.steps} steps, CPU")
    for step in range(args.steps):
        example = task.example(step)
        prompt = torch.tensor(tokenizer.encode(example.prompt), dtype=torch.long)
        t0 = time.perf_counter()
        resident = model.capture(prompt, block_size=args.block_size)
        t1 = time.perf_counter()
        rollout = generate(model, resident, args.group_size, sampling, generator)
        t2 = time.perf_counter()
        rewards = torch.tensor([reward_fn(tokenizer.decode(r.tolist()), example) for r in rollout.responses])
        result = tx.run(prompt, rollout.responses, rewards, resident=resident, old_logprobs=rollout.logprobs)
        console.print(
            f"step {step}: reward {rewards.mean():.3f}  loss {result.stats['loss']:+.5f}  "
            f"grad_norm {result.stats['grad_norm']:.3f}  tokens {int(result.stats['num_tokens'])}  "
            f"capture {t1 - t0:.2f}s  rollout {t2 - t1:.2f}s  replay {result.seconds['replay']:.2f}s  "
            f"resident {result.resident_bytes['total'] / 2**20:.2f} MiB  "
            f"graph peak {result.graph_peak_bytes / 2**20:.2f} MiB"
        )
    console.print("resident = K/V pages + GDN state (bytes); graph peak = largest live autograd graph, "
                  "i.e. one response's, whatever G")
    return 0
