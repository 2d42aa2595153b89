"""The prompt pages' whole attention backward (dq, dk and dv: exact mode's walk), on one GPU: triton_page_tiles.py's
`page_backward` (three products in one Triton launch a chunk of pages, dV and dK as cuBLAS GEMMs; the replay
backward's path where the head dim is a power of two) against the forward kernel's own backward over chunks of
BACKWARD_PAGE_CHUNK pages (`flash.attend_pages_backward`: cuDNN's, or aten flash's; the path before it), at a
model's attention shape.

Per page count: one capture block's queries (`--block` of them, the model's query heads) against P pages, bf16, no
new keys, their out and lse from the replay attention's own forward. Each path is timed from the replay's layout
(the folding of its rows and their delta included). Times (median ms, CUDA events) of each path and its TFLOP/s of
the five products (10 Q R P D); the extra peak each needs; dq, dk and dv of each tile chunk against the kernel's.
--configs times page_backward's launch under other tiles too (rows, pages, warps, stages; at the first chunk size).

    python scripts/bench/bench_pages_backward.py --model qwen36_mini --block 4096 --pages 65536,131072,262144 \
        --chunks 2048,4096,8192 --configs 128,64,8,1/128,32,8,2/64,64,4,2 --out pages_backward.jsonl
"""

from __future__ import annotations

import argparse
import datetime

import torch
from rows import emit, peak_gib, rel, time_ms

from longstraw_cli.models.qwen36.config import named_config
from longstraw_kernels.attention import flash
from longstraw_kernels.attention.triton_page_dq import DqConfig
from longstraw_kernels.attention.triton_page_tiles import page_backward


def tiles(q_BRQD, k_PKD, v_PKD, out_BRQD, lse_BQR, dout_BRQD, scale, **kw):
    """page_backward from the replay's layout -> (dq_KMD fp32, dk, dv)."""
    q_KMD, do_KMD, out_KMD, lse_KM = flash._fold_pages_rows(q_BRQD, dout_BRQD, out_BRQD, lse_BQR, k_PKD.shape[1])
    delta_KM = (do_KMD.float() * out_KMD.float()).sum(-1)
    return page_backward(q_KMD, do_KMD, lse_KM, delta_KM, k_PKD, v_PKD, scale, **kw)


def kernel_chunks(q_BRQD, k_PKD, v_PKD, out_BRQD, lse_BQR, dout_BRQD, scale):
    """The forward kernel's own backward over page chunks, from the replay's layout -> (dq_KMD fp32, dk, dv)."""
    q_KMD, do_KMD, out_KMD, lse_KM = flash._fold_pages_rows(q_BRQD, dout_BRQD, out_BRQD, lse_BQR, k_PKD.shape[1])
    return flash.attend_pages_backward(do_KMD, q_KMD, out_KMD, lse_KM, k_PKD, v_PKD, scale, flash.forward_backend())


def one(base, P, R, Q, K, D, chunks, configs, repeats):
    g = torch.Generator(device="cuda").manual_seed(0)
    q_BRQD = torch.randn(1, R, Q, D, generator=g, device="cuda").bfloat16()
    k_PKD, v_PKD = (torch.randn(P, K, D, generator=g, device="cuda").bfloat16() for _ in range(2))
    dout_BRQD = torch.randn(1, R, Q, D, generator=g, device="cuda").bfloat16()
    none_BSKD = k_PKD.new_empty(1, 0, K, D)
    scale = D**-0.5
    out_BRQD, lse_BQR = flash._FlashReplayAttention.apply(q_BRQD, k_PKD, v_PKD, none_BSKD, none_BSKD, scale, R)
    tflop = 10 * Q * R * P * D / 1e12
    row = dict(base, P=P, R=R, backend=flash.forward_backend())

    def run_kernel():
        return kernel_chunks(q_BRQD, k_PKD, v_PKD, out_BRQD, lse_BQR, dout_BRQD, scale)

    ms = time_ms(run_kernel, repeats)
    row.update(kernel_ms=round(ms, 2), kernel_tflops=round(tflop / ms * 1e3, 1),
               kernel_extra_peak_gib=round(peak_gib(run_kernel), 3))
    want = run_kernel()
    runs = [(f"tiles{chunk}", dict(chunk=chunk)) for chunk in chunks]
    runs += [("tiles_" + "_".join(str(x) for x in config.__dict__.values()), dict(chunk=chunks[0], config=config))
             for config in configs]
    for tag, kw in runs:
        def run_tiles(kw=kw):
            return tiles(q_BRQD, k_PKD, v_PKD, out_BRQD, lse_BQR, dout_BRQD, scale, **kw)

        try:
            ms = time_ms(run_tiles, repeats)
        except Exception as exc:  # tiles that do not fit the GPU's shared memory or registers
            row[f"{tag}_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            continue
        row[f"{tag}_ms"], row[f"{tag}_tflops"] = round(ms, 2), round(tflop / ms * 1e3, 1)
        row[f"{tag}_extra_peak_gib"] = round(peak_gib(run_tiles), 3)
        row[f"{tag}_rel"] = [round(rel(a, b), 5) for a, b in zip(run_tiles(), want)]
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
        emit(one(base, P, args.block, Q, K, D, chunks, configs, args.repeats), args.out)


if __name__ == "__main__":
    main()
