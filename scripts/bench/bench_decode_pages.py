"""The decode step's prompt-pages attention (longstraw_kernels/attention/decode.py, `decode_pages_attention`) at one
layer's shape, for several counts of page splits: each count's call compiled by torch.compile (as the decode step
runs it) and replayed as a CUDA graph, with its error against an fp32 softmax over all pages. One JSON row per
count; `tbs`: the pages' bytes over the time.

    python scripts/bench/bench_decode_pages.py --pages 262144 --kv 2 --heads 16 --dim 256 --group 8
"""

from __future__ import annotations

import argparse

import torch
from rows import emit, graph_ms

from longstraw_kernels.attention.decode import decode_pages_attention


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", type=int, default=262144)
    p.add_argument("--kv", type=int, default=2, help="kv heads (qwen36_mini: 2)")
    p.add_argument("--heads", type=int, default=16, help="query heads")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--group", type=int, default=8, help="responses (rows per query head)")
    p.add_argument("--splits", default="16,32,48,64,96,128,256")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    P, K, Q, D, B = args.pages, args.kv, args.heads, args.dim, args.group
    k, v = (torch.randn(P, K, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(B, Q, D, device="cuda", dtype=torch.bfloat16)
    scores = torch.einsum("bkgd,pkd->bkgp", q.float().reshape(B, K, Q // K, D), k.float()) * D**-0.5
    want = (torch.softmax(scores, -1) @ v.float().permute(1, 0, 2)[None]).reshape(B, Q, D)
    del scores
    for splits in (int(s) for s in args.splits.split(",")):
        fn = torch.compile(lambda s=splits: decode_pages_attention(q, k, v, scale=D**-0.5, num_splits=s))
        (out, _), ms = graph_ms(fn, 50)
        emit({"pages": P, "kv": K, "heads": Q, "dim": D, "group": B, "splits": splits, "ms": ms,
              "err": ((out.float() - want).norm() / want.norm()).item(), "tbs": 2 * k.nbytes / ms / 1e9}, args.out)


if __name__ == "__main__":
    main()
