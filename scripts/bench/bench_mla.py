"""Sparse absorbed-MLA attention (glm52 DSA replay): the torch reference against the Triton kernels, on one GPU.

First a correctness check at one size (the Triton forward and dq against an fp64 oracle on the same bf16 values;
the run stops if it fails). Then, for every H and T, the torch path (`reference._SparseMLA`, what runs with
kernels.mla=torch) and the Triton path (`triton_sparse.TritonSparseMLA`) are timed on the same inputs:
the forward under no_grad, and forward + backward with q requiring grad (the pages are resident state: no page
gradient, so the Triton backward is its dq kernel). One JSON line per size: milliseconds (median over repeats,
CUDA events), speedups, and the Triton path's TFLOP/s counting the matmuls only (forward 2 H K (A + L) per query,
dq 2 H K (2 A + L) on top). Indices are uniform random pages: no locality, the worst case for the gathers.

--sweep also times the forward and dq kernels alone under a few tile configurations per size (best first), to
choose `triton_sparse.default_config` and `unsplit_forward_config`.

    python scripts/bench/bench_mla.py --out mla.jsonl
    python scripts/bench/bench_mla.py --heads 64 --tokens 8192 --sweep
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
from rows import time_ms

from longstraw_kernels.mla import reference, triton_sparse
from longstraw_kernels.mla.triton_sparse import TileConfig

SWEEP = [TileConfig(h, k, w, s) for h, k, w, s in [
    (16, 32, 4, 2), (16, 64, 4, 2), (16, 32, 8, 2), (16, 16, 4, 3),
    (32, 32, 8, 2), (32, 16, 8, 3), (32, 64, 8, 2), (64, 16, 8, 2), (64, 32, 8, 1),
]]


def make_inputs(B, T, H, L, R, P, K, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, L + R, generator=g, device="cuda", dtype=dtype)
    latent = torch.randn(P, L, generator=g, device="cuda", dtype=dtype)
    rope = torch.randn(P, R, generator=g, device="cuda", dtype=dtype)
    idx = torch.randint(0, P, (B, T, K), generator=g, device="cuda")
    # a few entries absent, as where fewer keys are visible than the top-k
    idx = idx.masked_fill(torch.rand(B, T, K, generator=g, device="cuda") < 0.02, -1)
    return q, latent, rope, idx


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item() if torch.isfinite(a).all() else float("nan")


def check(L, R, P, K, scale) -> dict:
    """Triton forward and dq against the fp64 naive oracle, H = 16 and 64, T = 128, bf16 inputs."""
    errors = {}
    for H in (16, 64):
        q, latent, rope, idx = make_inputs(1, 128, H, L, R, P, K, torch.bfloat16, seed=1)
        idx[0, 5] = -1
        dout = torch.randn(q.shape[:3] + (L,), device="cuda", dtype=torch.bfloat16)
        out, lse = triton_sparse.sparse_mla_forward(q, latent, rope, idx, scale)
        dq = triton_sparse.sparse_mla_dq(q, latent, rope, idx, out, lse, dout, None, scale)
        q64 = q.double().requires_grad_()
        out_r, lse_r = reference.naive_sparse_mla_attention(q64, latent.double(), rope.double(), idx, scale=scale)
        (out_r * dout.double()).sum().backward()
        finite = torch.isfinite(lse_r)
        errors[H] = {"out": rel(out, out_r), "lse": rel(lse[finite], lse_r[finite]), "dq": rel(dq, q64.grad),
                     "empty_row_ok": bool(torch.isneginf(lse[0, 5]).all() and (dq[0, 5] == 0).all())}
        del q64, out_r, lse_r
    return errors


def bench_size(H, T, args, scale) -> dict:
    L, R, P, K = args.latent, args.rope, args.pages, args.topk
    q, latent, rope, idx = make_inputs(1, T, H, L, R, P, K, getattr(torch, args.dtype))
    dout = torch.randn(q.shape[:3] + (L,), device="cuda", dtype=q.dtype)
    row = {"H": H, "T": T, "L": L, "R": R, "P": P, "K": K, "dtype": args.dtype}
    paths = {"torch": reference._SparseMLA.apply, "triton": triton_sparse.TritonSparseMLA.apply}
    for name, fn in paths.items():
        with torch.no_grad():
            row[f"{name}_fwd_ms"] = time_ms(functools.partial(fn, q, latent, rope, idx, scale), args.repeats)
        q_grad = q.detach().requires_grad_()

        def fwd_bwd(fn=fn, q_grad=q_grad):
            out, _ = fn(q_grad, latent, rope, idx, scale)
            out.backward(dout)
            q_grad.grad = None

        row[f"{name}_fwd_bwd_ms"] = time_ms(fwd_bwd, args.repeats)
        torch.cuda.empty_cache()
    row["speedup_fwd"] = row["torch_fwd_ms"] / row["triton_fwd_ms"]
    row["speedup_fwd_bwd"] = row["torch_fwd_bwd_ms"] / row["triton_fwd_bwd_ms"]
    A = L + R
    fwd_flops = 2 * T * H * K * (A + L)
    row["triton_fwd_tflops"] = fwd_flops / row["triton_fwd_ms"] / 1e9
    row["triton_fwd_bwd_tflops"] = (fwd_flops + 2 * T * H * K * (2 * A + L)) / row["triton_fwd_bwd_ms"] / 1e9
    if args.sweep:
        row["sweep"] = sweep(q, latent, rope, idx, dout, scale, args.repeats)
    return row


def sweep(q, latent, rope, idx, dout, scale, repeats) -> dict:
    out, lse = triton_sparse.sparse_mla_forward(q, latent, rope, idx, scale)
    results = {"forward": [], "dq": []}
    for cfg in SWEEP:
        name = f"h{cfg.block_h}_k{cfg.block_k}_w{cfg.num_warps}_s{cfg.num_stages}"
        kernels = {
            "forward": functools.partial(triton_sparse.sparse_mla_forward, q, latent, rope, idx, scale, cfg),
            "dq": functools.partial(triton_sparse.sparse_mla_dq, q, latent, rope, idx, out, lse, dout, None, scale,
                                    cfg),
        }
        for kind, fn in kernels.items():
            try:
                results[kind].append((time_ms(fn, repeats), name))
            except Exception as exc:  # a tile too large for shared memory or registers fails to compile
                results[kind].append((float("inf"), f"{name}: {type(exc).__name__}"))
    return {kind: [f"{name} {ms:.2f} ms" for ms, name in sorted(rs)] for kind, rs in results.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="16,64")
    p.add_argument("--tokens", default="1024,8192")
    p.add_argument("--pages", type=int, default=262144)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--latent", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sweep", action="store_true", help="also time the kernels under the SWEEP tile configs")
    p.add_argument("--out", default=None, help="append the JSON lines to this file too")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_mla.py needs a CUDA GPU")
    scale = (args.latent + args.rope) ** -0.5

    errors = check(args.latent, args.rope, 50000, args.topk, scale)
    ok = all(e["out"] < 2e-2 and e["lse"] < 1e-3 and e["dq"] < 3e-2 and e["empty_row_ok"] for e in errors.values())
    print(json.dumps({"check": errors, "ok": ok, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}),
          flush=True)
    if not ok:
        sys.exit("Triton sparse MLA disagrees with the fp64 oracle; not timing it")

    for H in map(int, args.heads.split(",")):
        for T in map(int, args.tokens.split(",")):
            row = bench_size(H, T, args, scale)
            line = json.dumps(row)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
