"""What scoring the DSA indexer in FP8 (`kernels.dsa_scores=fp8`) changes in glm52 on one GPU, per prompt length:
the top-k sets the replay's queries select (FP8 against exact, from the same exact capture), the response's
log-probs (FP8 capture and replay against exact ones), and, for scale, the log-prob change bf16 makes by itself
(an exact capture in other block sizes). Random weights (no trained GLM-5 checkpoint here) and random tokens: the
figures say how far the rounding moves this model's selection, not a trained model's. One JSON row per length.

    python scripts/bench/dsa_fp8_effect.py --prompts 65536,262144 --out effect.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch

from longstraw_cli.models import build_model
from longstraw_cli.models.glm52.model import live_selection
from longstraw_kernels import use_kernels


def recorded_selections(model):
    """Wrap each "full" indexer layer's `select_fn` to keep what it selects -> the list it appends to."""
    seen = []
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.indexer is None:
            continue
        inner = attn.select_fn

        def record(positions_T, live, inner=inner):
            idx = inner(positions_T, live)
            seen.append((len(seen), idx.detach().clone()))
            return idx

        attn.select_fn = record
    return seen


def overlap(a_BTK, b_BTK):
    """Mean share of b's selected positions that a selects too, over queries (-1: none)."""
    shares = []
    for x, y in zip(a_BTK.reshape(-1, a_BTK.shape[-1]).tolist(), b_BTK.reshape(-1, b_BTK.shape[-1]).tolist()):
        ys = {v for v in y if v >= 0}
        shares.append(len({v for v in x if v >= 0} & ys) / max(1, len(ys)))
    return sum(shares) / len(shares)


def timed(fn):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="glm52_mini")
    p.add_argument("--prompts", default="65536,262144")
    p.add_argument("--response", type=int, default=512)
    p.add_argument("--block-size", type=int, default=8192)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script (fp32)")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(args.model, dtype=dtype, device=args.device, seed=0)
    vocab = model.config.vocab_size
    # the kernels of both modes compiled before anything is timed
    warm = torch.randint(0, vocab, (2 * args.block_size,), device=args.device)
    for mode in ("exact", "fp8"):
        with use_kernels(dsa_scores=mode):
            model.logprobs(model.capture(warm, block_size=args.block_size), warm[: args.response])
    for P in map(int, args.prompts.split(",")):
        g = torch.Generator().manual_seed(P)
        prompt = torch.randint(0, vocab, (P,), generator=g).to(args.device)
        response = torch.randint(0, vocab, (args.response,), generator=g).to(args.device)
        exact, t_exact = timed(functools.partial(model.capture, prompt, block_size=args.block_size))
        seen = recorded_selections(model)
        lp_exact = model.logprobs(exact, response).float()
        sel_exact = [idx for _, idx in seen]
        seen.clear()
        with use_kernels(dsa_scores="fp8"):
            lp_fp8_replay = model.logprobs(exact, response).float()
            sel_fp8 = [idx for _, idx in seen]
            fp8, t_fp8 = timed(functools.partial(model.capture, prompt, block_size=args.block_size))
            lp_fp8 = model.logprobs(fp8, response).float()
        del fp8
        seen.clear()
        # bf16's own noise: the same exact capture in blocks half as long
        other = model.capture(prompt, block_size=args.block_size // 2)
        lp_other = model.logprobs(other, response).float()
        del other
        for layer in model.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.select_fn = live_selection
        row = {
            "model": args.model, "prompt": P, "response": args.response,
            "capture_s": {"exact": round(t_exact, 3), "fp8": round(t_fp8, 3)},
            "replay_topk_overlap_by_full_layer": [round(overlap(b, a), 4) for a, b in zip(sel_exact, sel_fp8)],
            "mean_abs_dlogp": {
                "fp8_replay_of_exact_capture": float((lp_fp8_replay - lp_exact).abs().mean()),
                "fp8_capture_and_replay": float((lp_fp8 - lp_exact).abs().mean()),
                "bf16_other_block_size": float((lp_other - lp_exact).abs().mean()),
            },
            "max_abs_dlogp": {
                "fp8_capture_and_replay": float((lp_fp8 - lp_exact).abs().max()),
                "bf16_other_block_size": float((lp_other - lp_exact).abs().max()),
            },
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
        }
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        del exact
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
