"""The DSA selection rule (`topk_lowest_position`) on one GPU, at capture's chunk size, against the tie rule's scans
run on every row (`tie_rule_positions`: the rule as it ran before 2026-12-03) and torch.topk alone.

Per key count S: rows = 2^27 / S (glm52's `score_rows` on CUDA), fp32 uniform scores, the first eighth of the rows
with their second half -inf (fewer visible keys than a causal block's last rows see). Checks that both give the
same positions (fails loudly), then one JSON row of median ms (CUDA events).

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

from longstraw_kernels.dsa.topk import (
    _packed_key_positions,
    tie_rule_positions,
    topk_lowest_position,
    topk_lowest_position_static,
    two_topk_positions,
)


def measure(S: int, k: int, repeats: int) -> dict:
    R = (1 << 27) // S
    scores_RS = torch.rand(R, S, device="cuda")
    scores_RS[: R // 8, S // 2:] = float("-inf")
    if not torch.equal(topk_lowest_position(scores_RS, k), tie_rule_positions(scores_RS, k)):
        raise SystemExit(f"S={S}: the selections differ")
    return {"keys": S, "rows": R, "k": k, "gpu": torch.cuda.get_device_name(),
            "topk_lowest_position_ms": time_ms(lambda: topk_lowest_position(scores_RS, k), repeats),
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
    p.add_argument("--decode", action="store_true", help="the decode step's static selection (8 rows)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    for S in (int(s) for s in args.keys.split(",")):
        emit(measure_decode(S + 1024, args.k) if args.decode else measure(S, args.k, args.repeats), args.out)


if __name__ == "__main__":
    main()
