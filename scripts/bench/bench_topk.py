"""The DSA selection rule (`topk_lowest_position`: on CUDA the threshold select, triton_threshold.py) on one GPU, at
capture's chunk size, against the rule over whole rows by torch.topk (`_rule_rows`: what it ran before 2026-12-06),
the tie rule's scans run on every row (`tie_rule_positions`: the rule before 2026-12-03) and torch.topk alone.

Per key count S: rows = 2^27 / S (glm52's `score_rows` on CUDA), fp32 uniform scores, the first eighth of the rows
with their second half -inf (fewer visible keys than a causal block's last rows see); with --rising F, a fraction F
of the rows rising along the keys (the top-k in the last keys: more candidates than the threshold select holds, so
those rows take its rule over the whole row). Checks that all give the same positions (fails loudly), then one
JSON row of median ms (CUDA events) and the rows past the threshold select's candidates (`rows_over`).

    python scripts/bench/bench_topk.py --out topk.jsonl

`--decode`: the decode step's static selection instead (`topk_lowest_position_static`, no host synchronisation),
8 rows of S keys (a prompt's and 1,024 response slots' keys, the last 1,000 masked, some rows all ties), each
variant compiled by torch.compile and replayed as a CUDA graph as the decode step runs it: the radix select
(`triton_topk.py`, what the rule takes on CUDA), the one top-k over packed int64 keys (fp32 scores, before it) and
the two top-k's that wider scores take (`two_topk_positions`).
"""

from __future__ import annotations

import argparse

import torch
from rows import emit, graph_ms, time_ms

from longstraw_kernels.dsa import triton_threshold
from longstraw_kernels.dsa.topk import (
    _packed_key_positions,
    _rule_rows,
    tie_rule_positions,
    topk_lowest_position,
    topk_lowest_position_static,
    two_topk_positions,
)


def sweep(S: int, k: int, repeats: int, specs: str) -> dict:
    """The threshold select alone at each launch config of `specs` (maxima x block x warps x stages)."""
    R = (1 << 27) // S
    scores_RS = torch.rand(R, S, device="cuda")
    want = _rule_rows(scores_RS, k)
    row = {"mode": "threshold_sweep", "keys": S, "rows": R, "k": k, "gpu": torch.cuda.get_device_name()}
    for spec in specs.split(","):
        maxima, block, warps, stages = (int(v) for v in spec.split("x"))
        config = dict(maxima=maxima, block=block, warps=warps, stages=stages)
        try:
            out, candidates = triton_threshold.threshold_positions_triton(scores_RS, k, **config)
            if not torch.equal(out, want):
                raise SystemExit(f"S={S} {spec}: other keys than the rule's")
            row[f"{spec}_rows_over"] = int((candidates > triton_threshold.CAP).sum())
            row[f"{spec}_ms"] = time_ms(lambda c=config: triton_threshold.threshold_positions_triton(scores_RS, k, **c),
                                        repeats)
        except Exception as exc:  # noqa: BLE001 - a config the compiler refuses: noted
            row[f"{spec}_ms"] = f"{type(exc).__name__}: {str(exc)[:80]}"
    return row


def measure(S: int, k: int, repeats: int, rising: float) -> dict:
    R = (1 << 27) // S
    scores_RS = torch.rand(R, S, device="cuda")
    scores_RS[: R // 8, S // 2:] = float("-inf")
    scores_RS[R - int(R * rising):] += torch.linspace(0, 4, S, device="cuda")
    want = tie_rule_positions(scores_RS, k)
    if not (torch.equal(topk_lowest_position(scores_RS, k), want) and torch.equal(_rule_rows(scores_RS, k), want)):
        raise SystemExit(f"S={S}: the selections differ")
    over = (int((triton_threshold.threshold_positions_triton(scores_RS, k)[1] > triton_threshold.CAP).sum())
            if triton_threshold.serves(scores_RS, k) else None)
    return {"keys": S, "rows": R, "k": k, "rising": rising, "gpu": torch.cuda.get_device_name(), "rows_over": over,
            "topk_lowest_position_ms": time_ms(lambda: topk_lowest_position(scores_RS, k), repeats),
            "rule_rows_ms": time_ms(lambda: _rule_rows(scores_RS, k), repeats),
            "tie_rule_positions_ms": time_ms(lambda: tie_rule_positions(scores_RS, k), repeats),
            "torch_topk_ms": time_ms(lambda: scores_RS.topk(k + 1, dim=-1), repeats)}


def measure_decode(S: int, k: int) -> dict:
    scores_B1S = torch.rand(8, 1, S, device="cuda")
    scores_B1S[..., -1000:] = float("-inf")
    scores_B1S[0, 0, :5000] = 0.0  # a tie across the k-th place
    scores_B1S[1, 0, : 64 * k] = scores_B1S[1, 0, : 64 * k].round(decimals=2)
    scores_B1S[1, 0, 64 * k:] = float("-inf")
    expected = topk_lowest_position(scores_B1S, k)
    row = {"mode": "decode", "keys": S, "rows": 8, "k": k, "gpu": torch.cuda.get_device_name()}
    for name, fn in (("radix", topk_lowest_position_static), ("packed_keys", _packed_key_positions),
                     ("two_topk", two_topk_positions)):
        compiled = torch.compile(fn, dynamic=False)
        out, row[f"{name}_ms"] = graph_ms(lambda compiled=compiled: compiled(scores_B1S, k))
        if not torch.equal(out, expected):
            raise SystemExit(f"S={S}: {name} selects other keys than topk_lowest_position")
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", default="65536,262144", help="S values")
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rising", type=float, default=0.0, help="fraction of rows rising along the keys")
    p.add_argument("--decode", action="store_true", help="the decode step's static selection (8 rows)")
    p.add_argument("--sweep", default=None,
                   help="the threshold select alone at these launch configs: maxima x block x warps x stages, "
                        "comma-separated")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    for S in (int(s) for s in args.keys.split(",")):
        if args.sweep:
            row = sweep(S, args.k, args.repeats, args.sweep)
        else:
            row = measure_decode(S + 1024, args.k) if args.decode else measure(S, args.k, args.repeats, args.rising)
        emit(row, args.out)


if __name__ == "__main__":
    main()
