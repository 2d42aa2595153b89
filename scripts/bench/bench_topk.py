"""The DSA selection rule (`topk_lowest_position`) on one GPU, at capture's chunk size, against the tie rule's scans
run on every row (`tie_rule_positions`: the rule as it ran before 2026-12-03) and torch.topk alone.

Per key count S: rows = 2^27 / S (glm52's `score_rows` on CUDA), fp32 uniform scores, the first eighth of the rows
with their second half -inf (fewer visible keys than a causal block's last rows see). Checks that both give the
same positions (fails loudly), then one JSON row of median ms (CUDA events).

    python scripts/bench/bench_topk.py --out topk.jsonl
"""

from __future__ import annotations

import argparse

import torch
from rows import emit, time_ms

from longstraw_kernels.dsa.topk import tie_rule_positions, topk_lowest_position


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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", default="65536,262144", help="S values")
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    for S in (int(s) for s in args.keys.split(",")):
        emit(measure(S, args.k, args.repeats), args.out)


if __name__ == "__main__":
    main()
