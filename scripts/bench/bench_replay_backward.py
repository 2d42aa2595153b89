"""Replay attention's backward against frozen prompt pages, on one GPU: the pages' dq through triton_page_dq.py
against the forward kernel's own backward (cuDNN's or aten flash's: all five products, page chunks of
BACKWARD_PAGE_CHUNK, `flash.attend_pages_backward`; the "aten" columns), at a model's attention shape.

Per prompt length: one response of R tokens (q [1, R, Q, D]) against P frozen pages and its own R causal keys, bf16,
as one replay's attention layer sees them. Times (median ms, CUDA events): the forward alone, and forward + backward
with each page-dq path; the TFLOP/s column counts the products each path must do (forward 2, backward 3 for the
pages: S, dP and dq). Errors: both paths' dq against each other and, at the smallest P, against the fp64 reference.

--sweep also times page_dq alone under a few DqConfigs at the largest P (to choose DEFAULT_CONFIG).

    python scripts/bench/bench_replay_backward.py --model qwen36_mini --prompt 131072,1048576 --sweep
"""

from __future__ import annotations

import argparse
import datetime
import math

import torch
from rows import emit, rel, time_ms

from longstraw_cli.models.qwen36.config import named_config
from longstraw_kernels.attention import flash, replay_attention
from longstraw_kernels.attention import triton_page_dq as tpd
from longstraw_kernels.attention.reference import replay_attention as reference

SWEEP = [tpd.DqConfig(*c) for c in [
    (64, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2), (64, 32, 8, 3), (128, 32, 8, 2), (128, 64, 8, 2),
    (128, 64, 8, 1), (64, 128, 8, 2), (128, 32, 4, 2),
]]


def inputs(R, P, Q, K, D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").bfloat16()

    return randn(1, R, Q, D), randn(P, K, D), randn(P, K, D), randn(1, R, K, D), randn(1, R, K, D)


def dq_of(q, kp, vp, kn, vn, dout, scale, triton_dq: bool):
    """dq through the replay attention; with triton_dq False the frozen pages' share through the forward kernel's
    own backward over page chunks (`flash.attend_pages_backward`: the route of head dims the Triton page kernels do
    not take, and every head dim's before triton_page_dq)."""
    supported = flash.triton_pages_supported
    if not triton_dq:
        flash.triton_pages_supported = lambda *pages: False
    try:
        leaf = q.detach().requires_grad_(True)
        out = replay_attention(leaf, kp, vp, kn, vn, scale=scale)
        (dq,) = torch.autograd.grad(out, leaf, dout)
    finally:
        flash.triton_pages_supported = supported
    return dq


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen36_mini")
    parser.add_argument("--prompt", default="131072,1048576", help="comma-separated page counts")
    parser.add_argument("--response", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cfg = named_config(args.model)
    Q, K, D, R = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, args.response
    base = {"bench": "replay_backward", "model": args.model, "R": R, "Q": Q, "K": K, "D": D,
            "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__, "backend": flash.forward_backend()}
    prompts = [int(p) for p in args.prompt.split(",")]
    for P in prompts:
        emit(one_prompt(base, P, R, Q, K, D, args.repeats, with_fp64=P == min(prompts) <= 1 << 17), args.out)
    if args.sweep:
        P = max(prompts)
        q, kp, vp, _, _ = inputs(R, P, Q, K, D)
        M = R * (Q // K)
        q_KMD = flash._fold_pages_query(q, K)[0]
        do_KMD = torch.randn_like(q_KMD)
        lse_KM = torch.full((K, M), math.log(P) + 0.5, device="cuda")  # ~ the lse of unit-variance scores
        delta_KM = torch.randn(K, M, device="cuda")
        scale = D**-0.5
        want = tpd.page_dq(q_KMD, do_KMD, lse_KM, delta_KM, kp, vp, scale)
        for config in SWEEP:
            try:
                ms = time_ms(lambda c=config: tpd.page_dq(q_KMD, do_KMD, lse_KM, delta_KM, kp, vp, scale, c),
                             args.repeats)
                got = tpd.page_dq(q_KMD, do_KMD, lse_KM, delta_KM, kp, vp, scale, config)
                err = rel(got, want)
            except Exception as exc:  # a config that does not fit the GPU's shared memory or registers
                ms, err = None, f"{type(exc).__name__}: {str(exc)[:120]}"
            emit(dict(base, bench="replay_backward_sweep", P=P, config=list(config.__dict__.values()), ms=ms,
                      tflops_3=None if ms is None else round(3 * 2 * R * Q * P * D / 1e12 / ms * 1e3, 1),
                      rel_vs_default=err), args.out)


def one_prompt(base, P, R, Q, K, D, repeats, with_fp64):
    scale = D**-0.5
    q, kp, vp, kn, vn = inputs(R, P, Q, K, D)
    dout = torch.randn_like(q)
    matmul_tflop = 2 * R * Q * P * D / 1e12  # one product against the pages
    fwd = time_ms(lambda: replay_attention(q, kp, vp, kn, vn, scale=scale), repeats)
    row = dict(base, P=P, forward_ms=round(fwd, 2), forward_tflops=round(2 * matmul_tflop / fwd * 1e3, 1))
    dqs = {}
    for name, use in (("aten", False), ("triton", True)):
        ms = time_ms(lambda use=use: dq_of(q, kp, vp, kn, vn, dout, scale, use), repeats)
        row[f"{name}_fwd_bwd_ms"] = round(ms, 2)
        row[f"{name}_bwd_ms"] = round(ms - fwd, 2)
        row[f"{name}_bwd_tflops_3"] = round(3 * matmul_tflop / (ms - fwd) * 1e3, 1)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        dqs[name] = dq_of(q, kp, vp, kn, vn, dout, scale, use)
        row[f"{name}_extra_peak_gib"] = round((torch.cuda.max_memory_allocated() - before) / 2**30, 3)
    row["dq_rel_triton_vs_aten"] = rel(dqs["triton"], dqs["aten"])
    if with_fp64:
        q64 = q.double().requires_grad_(True)
        ref = reference(q64, kp.double(), vp.double(), kn.double(), vn.double(), scale=scale)
        (want,) = torch.autograd.grad(ref, q64, dout.double())
        row["dq_rel_triton_vs_fp64"], row["dq_rel_aten_vs_fp64"] = rel(dqs["triton"], want), rel(dqs["aten"], want)
    return row


if __name__ == "__main__":
    main()
