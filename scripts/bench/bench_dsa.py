"""DSA indexer scores on one GPU: the torch reference against the fused Triton kernel (longstraw_kernels/dsa).

Capture-like: B = 1, the T queries are the last T of S positions (offset S - T, so the kernel skips the key
tiles past each query tile's diagonal), keys shared [S, I], bf16 q and k, fp32 scores. First a correctness check
on the first size (kernel vs reference, fails loudly), then per (T, S) one JSON row: median ms of both
(triton.testing.do_bench), speedup, the kernel's TFLOP/s over the visible (query, key) pairs, max abs diff of the
finite scores and whether the -inf positions agree. --configs times other tile shapes of the kernel too. For few
queries (the decode's: --queries 8) the few-rows form with the heads folded into the dot's rows
(`indexer_scores_folded_triton`, a few programs an SM looping over the key tiles) is checked and timed at several
key blocks.

    python scripts/bench/bench_dsa.py --out dsa.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton

from longstraw_kernels.dsa import indexer_scores_reference
from longstraw_kernels.dsa.triton_scores import (
    LOW_PRECISION_CONFIG,
    folded_serves,
    indexer_scores_folded_triton,
    indexer_scores_triton,
)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# block_t x block_s x num_warps x num_stages
DEFAULT_CONFIGS = ",".join(["x".join(map(str, LOW_PRECISION_CONFIG)), "64x128x4x2", "64x128x8x2", "128x128x8x2",
                            "64x256x8x3", "128x64x4x3"])


def make_inputs(T, S, J, I, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q_BTJI = torch.randn(1, T, J, I, generator=g, device="cuda").to(dtype)
    w_BTJ = torch.randn(1, T, J, generator=g, device="cuda") * J**-0.5
    k_SI = torch.randn(S, I, generator=g, device="cuda").to(dtype)
    return q_BTJI, w_BTJ, k_SI


def compare(out_BTS, ref_BTS, rows=1024):
    """-> (max abs diff of the finite scores, RMS-relative error, -inf positions equal), rows at a time."""
    max_diff, err_sq, ref_sq, same_inf = 0.0, 0.0, 0.0, True
    for t0 in range(0, ref_BTS.shape[1], rows):
        a, b = out_BTS[:, t0 : t0 + rows].double(), ref_BTS[:, t0 : t0 + rows].double()
        finite = torch.isfinite(b)
        same_inf &= torch.equal(finite, torch.isfinite(a))
        d = torch.where(finite, a - b, 0)
        max_diff = max(max_diff, d.abs().max().item())
        err_sq += d.pow(2).sum().item()
        ref_sq += torch.where(finite, b, 0).pow(2).sum().item()
    return max_diff, (err_sq / ref_sq) ** 0.5, same_inf


def visible_pairs(T, S, offset):
    t = torch.arange(T, dtype=torch.float64)
    return (t + offset + 1).clamp(0, S).sum().item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--queries", default="4096,16384", help="T values")
    p.add_argument("--keys", default="65536,262144", help="S values")
    p.add_argument("--heads", type=int, default=16, help="J index heads")
    p.add_argument("--head-dim", type=int, default=128, help="I index head dim")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="kernel tile shapes to time, comma separated")
    p.add_argument("--rep", type=int, default=200, help="do_bench time budget per measurement, ms")
    p.add_argument("--out", default=None, help="append the JSON rows to this file too")
    args = p.parse_args(argv)
    dtype, J, I = DTYPES[args.dtype], args.heads, args.head_dim
    scale = I**-0.5
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    sizes = [(T, S) for T in map(int, args.queries.split(",")) for S in map(int, args.keys.split(",")) if T <= S]

    # correctness first, on the first size: a wrong kernel must not produce a speedup
    T, S = sizes[0]
    q_BTJI, w_BTJ, k_SI = make_inputs(T, S, J, I, dtype)
    max_diff, err, same_inf = compare(indexer_scores_triton(q_BTJI, w_BTJ, k_SI, scale, S - T),
                                      indexer_scores_reference(q_BTJI, w_BTJ, k_SI, scale, S - T))
    print(json.dumps({"check": f"T={T} S={S}", "max_abs_diff": max_diff, "rel_err": err, "same_inf": same_inf}))
    if not same_inf or not err < 1e-5:
        raise SystemExit(f"kernel disagrees with the reference: rel err {err:.3e}, -inf positions equal {same_inf}")
    del q_BTJI, w_BTJ, k_SI

    for T, S in sizes:
        q_BTJI, w_BTJ, k_SI = make_inputs(T, S, J, I, dtype)
        offset = S - T
        ref_BTS = indexer_scores_reference(q_BTJI, w_BTJ, k_SI, scale, offset)
        out_BTS = indexer_scores_triton(q_BTJI, w_BTJ, k_SI, scale, offset)
        max_diff, err, same_inf = compare(out_BTS, ref_BTS)
        del ref_BTS, out_BTS
        torch.cuda.empty_cache()
        reference = functools.partial(indexer_scores_reference, q_BTJI, w_BTJ, k_SI, scale, offset)
        ref_ms = triton.testing.do_bench(reference, rep=args.rep, return_mode="median")
        by_config = {}
        for config in configs:
            fn = functools.partial(indexer_scores_triton, q_BTJI, w_BTJ, k_SI, scale, offset, config=config)
            by_config["x".join(map(str, config))] = triton.testing.do_bench(fn, rep=args.rep, return_mode="median")
        kernel_ms = by_config["x".join(map(str, configs[0]))]
        folded = {}
        if folded_serves(q_BTJI, k_SI):
            ref_BTS = indexer_scores_reference(q_BTJI, w_BTJ, k_SI, scale, offset)
            folded_err = compare(indexer_scores_folded_triton(q_BTJI, w_BTJ, k_SI, scale, offset), ref_BTS)
            if not folded_err[2] or not folded_err[1] < 1e-5:
                raise SystemExit(f"the folded kernel disagrees with the reference: {folded_err}")
            del ref_BTS
            by_block = {}
            for block_s in (32, 64, 128, 256):
                fn = functools.partial(indexer_scores_folded_triton, q_BTJI, w_BTJ, k_SI, scale, offset,
                                       block_s=block_s)
                by_block[block_s] = round(triton.testing.do_bench(fn, rep=args.rep, return_mode="median"), 4)
            # at its default key block: what the dispatch runs
            default_ms = round(triton.testing.do_bench(functools.partial(
                indexer_scores_folded_triton, q_BTJI, w_BTJ, k_SI, scale, offset), rep=args.rep,
                return_mode="median"), 4)
            folded = {"folded_ms_by_block_s": by_block, "folded_rel_err": folded_err[1],
                      "folded_default_ms": default_ms}
        best = min(by_config, key=by_config.get)
        row = {
            "T": T, "S": S, "J": J, "I": I, "dtype": args.dtype, "offset": offset,
            "reference_ms": round(ref_ms, 3), "kernel_ms": round(kernel_ms, 3),
            "speedup": round(ref_ms / kernel_ms, 2),
            "kernel_tflops": round(2 * J * I * visible_pairs(T, S, offset) / (kernel_ms * 1e-3) / 1e12, 1),
            "best_config": best, "best_ms": round(by_config[best], 3),
            "kernel_ms_by_config": {c: round(ms, 3) for c, ms in by_config.items()},
            "max_abs_diff": max_diff, "rel_err": err, "same_inf": same_inf,
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1), **folded,
        }
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        del q_BTJI, w_BTJ, k_SI
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
