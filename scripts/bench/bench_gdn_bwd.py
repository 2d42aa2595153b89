"""GDN forward + backward on one GPU: the Triton chunked op (longstraw_kernels/gdn/triton_chunk.py) against the torch
chunked reference's autograd (gdn_chunked, what every gradient ran through before), at one model's GDN shape.

For every T: q, k (L2-normalised) and v in bf16, g, beta and the initial state in fp32, every input requiring grad,
random cotangents on o and on the final state. Both paths are timed forward alone (building the graph) and
forward + backward (triton.testing.do_bench, median ms), with the memory each adds at its peak. Then both run once
more on the same values in fp32, and the row gives the Triton op's max abs and RMS-relative errors against
gdn_chunked for o, the final state and every gradient. One JSON line per T.

--sweep also times the two scan kernels alone under a few ScanConfigs at the largest T (to choose
`triton_chunk.DEFAULT_CONFIG`).

    python scripts/bench/bench_gdn_bwd.py --tokens 4096,16384,65536 --sweep
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from rows import emit, peak_gib
from triton.testing import do_bench

from longstraw_cli.models.qwen36.config import named_config
from longstraw_kernels.gdn import gdn_chunked, triton_chunk
from longstraw_kernels.gdn.reference import chunk_terms, prepare_inputs

NAMES = ("q", "k", "v", "g", "beta", "state")
SWEEP = [triton_chunk.ScanConfig(*c) for c in [
    (16, 8, 1), (16, 4, 1), (16, 16, 1), (16, 8, 2), (32, 4, 1), (32, 8, 1), (32, 16, 1), (64, 16, 1),
]]


def make_inputs(T, H, G, K, V, seed=0):
    """name -> tensor on CUDA in the benchmark's dtypes, plus cotangents (do bf16, dfinal fp32)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    x = {
        "q": F.normalize(randn(1, T, H, K), dim=-1).bfloat16(),
        "k": F.normalize(randn(1, T, H, K), dim=-1).bfloat16(),
        "v": randn(1, T, G, V).bfloat16(),
        "g": -F.softplus(randn(1, T, G)),
        "beta": torch.sigmoid(randn(1, T, G)),
        "state": randn(1, G, K, V) * 0.1,
    }
    return x, (randn(1, T, G, V).bfloat16(), randn(1, G, K, V))


def fwd_bwd(op, x, cot):
    """-> (o, final, grads of every input) of op on fresh leaves of x."""
    leaves = [x[n].detach().requires_grad_() for n in NAMES]
    o, final = op(*leaves)
    grads = torch.autograd.grad([o, final], leaves, [c.to(t.dtype) for c, t in zip(cot, (o, final))])
    return o, final, grads


def errors(x, cot) -> dict:
    """Max abs and RMS-relative errors of the Triton op against gdn_chunked, both on fp32 copies of x."""
    x32 = {n: t.float() for n, t in x.items()}
    cot32 = tuple(c.float() for c in cot)
    ours = fwd_bwd(triton_chunk.gdn_chunked_triton, x32, cot32)
    ref = fwd_bwd(gdn_chunked, x32, cot32)
    names = ["o", "final"] + [f"d{n}" for n in NAMES]
    flat = lambda out: [out[0], out[1], *out[2]]  # noqa: E731
    max_abs, rel = {}, {}
    for name, a, b in zip(names, flat(ours), flat(ref)):
        a, b = a.detach().double(), b.detach().double()
        max_abs[name] = float((a - b).abs().max())
        rel[name] = float((a - b).norm() / b.norm())
    return {"fp32_max_abs_err": max_abs, "fp32_rel_err": rel}


def bench_size(T, shape) -> dict:
    x, cot = make_inputs(T, **shape)
    row = {"T": T, "B": 1, **shape, "chunk": 64}
    for name, op in (("torch", gdn_chunked), ("triton", triton_chunk.gdn_chunked_triton)):
        row[f"{name}_fwd_ms"] = do_bench(lambda op=op: op(*(x[n].detach().requires_grad_() for n in NAMES)),
                                         return_mode="median")
        row[f"{name}_fwd_bwd_ms"] = do_bench(lambda op=op: fwd_bwd(op, x, cot), return_mode="median")
        row[f"{name}_peak_gib"] = peak_gib(lambda op=op: fwd_bwd(op, x, cot))
    row["speedup_fwd_bwd"] = row["torch_fwd_bwd_ms"] / row["triton_fwd_bwd_ms"]
    row["speedup_fwd"] = row["torch_fwd_ms"] / row["triton_fwd_ms"]
    # where the Triton path's time goes: the batched torch terms (forward alone; one of their two triangular
    # solves on its own) against the two scans
    with torch.no_grad():
        prepared = prepare_inputs(*(x[n] for n in NAMES), None)
        row["terms_fwd_ms"] = do_bench(lambda: chunk_terms(*prepared[:5], 64), return_mode="median")
        terms = chunk_terms(*prepared[:5], 64)
        a_BGNCC = terms.attn_BGNCC.tril(-1)
        row["one_solve_ms"] = do_bench(lambda: torch.linalg.solve_triangular(
            a_BGNCC, terms.w_v_BGNCV, upper=False, unitriangular=True), return_mode="median")
        row["scan_fwd_ms"] = do_bench(lambda: triton_chunk.scan_forward(terms, prepared[5]), return_mode="median")
        u, states, _ = triton_chunk.scan_forward(terms, prepared[5])
        row["scan_bwd_ms"] = do_bench(lambda: triton_chunk.scan_backward(terms, u.clone(), states.clone(),
                                                                         prepared[5]), return_mode="median")
    row.update(errors(x, cot))
    return row


def sweep(T, shape) -> None:
    """Times scan_forward and scan_backward alone under each ScanConfig (failures, e.g. out of resources, noted)."""
    x, _ = make_inputs(T, **shape)
    with torch.no_grad():
        prepared = prepare_inputs(*(x[n] for n in NAMES), None)
        terms = chunk_terms(*prepared[:5], 64)
        u, states, _ = triton_chunk.scan_forward(terms, prepared[5])
        for config in SWEEP:
            row = {"sweep": T, "block_v": config.block_v, "num_warps": config.num_warps,
                   "num_stages": config.num_stages}
            try:
                row["scan_fwd_ms"] = do_bench(lambda c=config: triton_chunk.scan_forward(terms, prepared[5], c),
                                              return_mode="median")
                row["scan_bwd_ms"] = do_bench(lambda c=config: triton_chunk.scan_backward(
                    terms, u.clone(), states.clone(), prepared[5], c), return_mode="median")
            except Exception as exc:  # noqa: BLE001 - a config the compiler refuses is a row, not the end
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            emit(row, None)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen36_mini", help="a qwen36 named config: its GDN heads and dims")
    p.add_argument("--tokens", default="4096,16384,65536", help="comma list of T")
    p.add_argument("--sweep", action="store_true", help="time the scan kernels under a few configs first")
    p.add_argument("--out", default=None, help="JSON lines, appended")
    args = p.parse_args(argv)
    cfg = named_config(args.model)
    shape = dict(H=cfg.linear_num_key_heads, G=cfg.linear_num_value_heads, K=cfg.linear_key_head_dim,
                 V=cfg.linear_value_head_dim)
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.sweep:
        sweep(max(tokens), shape)
    for T in tokens:
        emit({"model": args.model, **bench_size(T, shape)}, args.out)


if __name__ == "__main__":
    main()
