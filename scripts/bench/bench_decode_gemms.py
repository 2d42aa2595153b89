"""The decode step's projection GEMMs at M = B rows (qwen36), one CUDA graph over every layer, as the step replays
them: each layer's linears one by one (what the model's modules run: GDN's in_proj_qkv / z / b / a, attention's
q / k / v, the MLP's gate and up, then the out / o and down projections) against the same with each layer's input
projections concatenated (GDN 4 -> 1, attention 3 -> 1, gate + up 2 -> 1). The question it answers: what fusing
the decode step's in-projections would save, before building it. Also the lm_head, and `bound_ms`: the weights'
bytes at the rate of a device-to-device copy (1 GiB read and written), a reference point only: a GEMM that only
reads can beat it (on an H200 the lm_head read at 4.1 TB/s, the copy moved 2.8).

    python scripts/bench/bench_decode_gemms.py --shapes qwen36_mini,qwen36 --tokens 8 --out gemms.jsonl
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from rows import emit, graph_ms

from longstraw_cli.models.qwen36.config import NAMED_CONFIGS


def layer_weights(cfg, kind: str, bf16: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the mixer's input projections [N, C], then its output projection and the MLP's down) of one layer."""
    C = cfg.hidden_size
    if kind == "linear_attention":
        value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        ins = [cfg.conv_dim, value, cfg.linear_num_value_heads, cfg.linear_num_value_heads]
        outs = [(C, value)]
    else:
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        ins, outs = [2 * q, kv, kv], [(C, q)]
    return ([torch.randn(n, C, **bf16) * 0.02 for n in ins],
            [torch.randn(*shape, **bf16) * 0.02 for shape in outs + [(C, cfg.intermediate_size)]])


def measure(shape: str, B: int, layers: int | None) -> dict:
    cfg = NAMED_CONFIGS[shape]
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    kinds = cfg.layer_types[:layers]
    separate, fused = [], []
    for kind in kinds:
        ins, outs = layer_weights(cfg, kind, bf16)
        mlp = [torch.randn(cfg.intermediate_size, cfg.hidden_size, **bf16) * 0.02 for _ in range(2)]
        separate.append((ins, outs, mlp))
        fused.append(([torch.cat(ins)], outs, [torch.cat(mlp)]))
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, **bf16) * 0.02
    x_BC = torch.randn(B, cfg.hidden_size, **bf16)
    # the output projections' inputs (their values do not matter here, only their shapes)
    mixed = {"linear_attention": torch.randn(B, cfg.linear_num_value_heads * cfg.linear_value_head_dim, **bf16),
             "full_attention": torch.randn(B, cfg.num_attention_heads * cfg.head_dim, **bf16)}
    act_BI = torch.randn(B, cfg.intermediate_size, **bf16)

    def run(form):
        for kind, (ins, outs, mlp) in zip(kinds, form):
            for w in ins + mlp:
                F.linear(x_BC, w)
            F.linear(mixed[kind], outs[0])
            F.linear(act_BI, outs[1])

    weight_bytes = sum(w.numel() * 2 for layer in separate for part in layer for w in part)
    row = {"shape": shape, "tokens": B, "layers": len(kinds), "weights_gib": weight_bytes / 2**30,
           "gemms_separate": sum(len(ins) + len(outs) + len(mlp) for ins, outs, mlp in separate),
           "gemms_fused": sum(len(ins) + len(outs) + len(mlp) for ins, outs, mlp in fused),
           "gpu": torch.cuda.get_device_name()}
    _, row["separate_ms"] = graph_ms(lambda: run(separate), 50)
    _, row["fused_ms"] = graph_ms(lambda: run(fused), 50)
    _, row["lm_head_ms"] = graph_ms(lambda: F.linear(x_BC, lm_head), 50)
    # the bandwidth a copy reaches: read + write of 1 GiB each
    src = torch.empty(2**29, **bf16)
    dst = torch.empty_like(src)
    _, copy_ms = graph_ms(lambda: dst.copy_(src), 20)
    row["copy_tb_s"] = 2 * src.numel() * 2 / copy_ms / 1e9
    row["bound_ms"] = weight_bytes / (row["copy_tb_s"] * 1e9)
    row["lm_head_bound_ms"] = lm_head.numel() * 2 / (row["copy_tb_s"] * 1e9)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen36_mini", help="named qwen36 shapes")
    p.add_argument("--tokens", default="8", help="B values (the group size G of one rank's decode)")
    p.add_argument("--layers", type=int, default=None, help="the first N layers only (default: all)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        for B in (int(b) for b in args.tokens.split(",")):
            emit(measure(shape, B, args.layers), args.out)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
