"""The prompt pages' whole attention backward (dq, dk and dv: exact mode's walk), on one GPU: the replay backward's
path (`attend_backward`, cuDNN's or aten flash's, over chunks of BACKWARD_PAGE_CHUNK pages) against
triton_page_tiles.py's (three products in one Triton launch a chunk of pages, dV and dK as cuBLAS GEMMs), at a
model's attention shape.

Per page count: the folded query rows of one capture block (`--block` queries x the G query heads of a kv group,
[1, K, M, D]) against P pages, bf16, their out and lse from the forward (`attend_pages`). Times (median ms, CUDA
events) of each path and its TFLOP/s of the five products (10 K M P D); the extra peak each needs; dq, dk and dv of
each tile chunk against the current path's. --configs times page_backward's launch under other tiles too (rows,
pages, warps, stages; at the first chunk size).

    python scripts/bench/bench_pages_backward.py --model qwen36_mini --block 4096 --pages 65536,131072,262144 \
        --chunks 2048,4096,8192 --configs 128,64,8,1/128,32,8,2/64,64,4,2 --out pages_backward.jsonl
"""

from __future__ import annotations

import argparse
import datetime

import torch
from rows import emit, peak_gib, time_ms

from longstraw_cli.models.qwen36.config import named_config
from longstraw_kernels.attention import flash
from longstraw_kernels.attention.triton_page_dq import DqConfig
from longstraw_kernels.attention.triton_page_tiles import page_backward


def current(do_1KMD, q_1KMD, k_PKD, v_PKD, out_1KMD, lse_1KM, scale, backend):
    """flash_replay_attention_backward's pages branch: attend_backward over page chunks."""
    P = k_PKD.shape[0]
    dq = torch.zeros(q_1KMD.shape, dtype=torch.float32, device=q_1KMD.device)
    dk, dv = torch.empty_like(k_PKD), torch.empty_like(v_PKD)
    for p0 in range(0, P, flash.BACKWARD_PAGE_CHUNK):
        p1 = min(P, p0 + flash.BACKWARD_PAGE_CHUNK)
        dq_c, dk_c, dv_c = flash.attend_backward(do_1KMD, q_1KMD, k_PKD[p0:p1].transpose(0, 1)[None],
                                                 v_PKD[p0:p1].transpose(0, 1)[None], out_1KMD, lse_1KM, False,
                                                 scale, backend)
        dq += dq_c.float()
        dk[p0:p1], dv[p0:p1] = dk_c[0].transpose(0, 1), dv_c[0].transpose(0, 1)
    return dq[0], dk, dv


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def one(base, P, M, K, D, chunks, configs, repeats):
    g = torch.Generator(device="cuda").manual_seed(0)
    q_1KMD = torch.randn(1, K, M, D, generator=g, device="cuda").bfloat16()
    k_PKD, v_PKD = (torch.randn(P, K, D, generator=g, device="cuda").bfloat16() for _ in range(2))
    do_1KMD = torch.randn(1, K, M, D, generator=g, device="cuda").bfloat16()
    scale, backend = D**-0.5, flash.forward_backend()
    out_1KMD, lse_1KM = flash.attend_pages(q_1KMD, k_PKD, v_PKD, scale, backend)
    out_1KMD = out_1KMD.bfloat16()
    delta_KM = (do_1KMD.float() * out_1KMD.float()).sum(-1)[0]
    tflop = 10 * K * M * P * D / 1e12
    row = dict(base, P=P, M=M, backend=backend)

    def run_current():
        return current(do_1KMD, q_1KMD, k_PKD, v_PKD, out_1KMD, lse_1KM, scale, backend)

    ms = time_ms(run_current, repeats)
    row.update(current_ms=round(ms, 2), current_tflops=round(tflop / ms * 1e3, 1),
               current_extra_peak_gib=round(peak_gib(run_current), 3))
    want = run_current()
    for chunk in chunks:
        def run_tiles(chunk=chunk):
            return page_backward(q_1KMD[0], do_1KMD[0], lse_1KM[0], delta_KM, k_PKD, v_PKD, scale, chunk=chunk)

        ms = time_ms(run_tiles, repeats)
        got = run_tiles()
        row[f"tiles{chunk}_ms"] = round(ms, 2)
        row[f"tiles{chunk}_tflops"] = round(tflop / ms * 1e3, 1)
        row[f"tiles{chunk}_extra_peak_gib"] = round(peak_gib(run_tiles), 3)
        row[f"tiles{chunk}_rel"] = [round(rel(a, b), 5) for a, b in zip(got, want)]
    for config in configs:
        def run_config(config=config):
            return page_backward(q_1KMD[0], do_1KMD[0], lse_1KM[0], delta_KM, k_PKD, v_PKD, scale, chunk=chunks[0],
                                 config=config)

        tag = "tiles_" + "_".join(str(x) for x in config.__dict__.values())
        try:
            ms = time_ms(run_config, repeats)
            row[f"{tag}_ms"], row[f"{tag}_tflops"] = round(ms, 2), round(tflop / ms * 1e3, 1)
        except Exception as exc:  # tiles that do not fit the GPU's shared memory or registers
            row[f"{tag}_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen36_mini")
    parser.add_argument("--block", type=int, default=4096, help="queries of one capture block")
    parser.add_argument("--pages", default="65536,131072,262144", help="comma-separated page counts")
    parser.add_argument("--chunks", default="2048,4096,8192", help="page_backward's chunk sizes")
    parser.add_argument("--configs", default="", help="'/'-separated tiles to time too: rows,pages,warps,stages")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cfg = named_config(args.model)
    Q, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    base = {"bench": "pages_backward", "model": args.model, "block": args.block, "Q": Q, "K": K, "D": D,
            "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__}
    chunks = [int(c) for c in args.chunks.split(",")]
    configs = [DqConfig(*(int(x) for x in c.split(","))) for c in args.configs.split("/") if c]
    for P in (int(p) for p in args.pages.split(",")):
        emit(one(base, P, args.block * (Q // K), K, D, chunks, configs, args.repeats), args.out)


if __name__ == "__main__":
    main()
