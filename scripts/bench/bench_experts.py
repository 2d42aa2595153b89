"""The static decode step's routed experts on one GPU: every expert densely (`dense_experts`) against the grouped
GEMMs over the step's (token, expert) pairs (`grouped_experts`) and the decode linear kernel over the chosen experts
(`skinny_experts`, the default since 2026-12-04), one MoE layer, bf16, B tokens each routed to k random experts,
each function compiled by torch.compile and replayed as a CUDA graph, as the decode step runs it. The decoder takes
the skinny kernel where it serves, else the grouped GEMMs where B x k < E (models/glm52/decode.py); this is the
measurement behind that.

    python scripts/bench/bench_experts.py --out experts.jsonl
"""

from __future__ import annotations

import argparse

import torch
from rows import emit, graph_ms

from longstraw_cli.models.glm52.config import NAMED_CONFIGS
from longstraw_cli.models.glm52.experts import dense_experts, grouped_experts, skinny_experts


def measure(shape: str, B: int) -> dict:
    cfg = NAMED_CONFIGS[shape]
    E, k, C, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    gate_up_EXC, down_ECI = torch.randn(E, 2 * I, C, **bf16) * 0.02, torch.randn(E, C, I, **bf16) * 0.02
    x_BC = torch.randn(B, C, **bf16)
    idx_Bk = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(B)])
    w_Bk = torch.rand(B, k, device="cuda")
    row = {"shape": shape, "tokens": B, "experts": E, "k": k, "chosen": int(idx_Bk.unique().numel()),
           "weights_gib": 3 * E * I * C * 2 / 2**30, "gpu": torch.cuda.get_device_name()}
    outputs = {}
    for name, fn in (("dense", dense_experts), ("grouped", grouped_experts), ("skinny", skinny_experts)):
        compiled = torch.compile(fn)
        outputs[name], row[f"{name}_ms"] = graph_ms(
            lambda compiled=compiled: compiled(x_BC, idx_Bk, w_Bk, gate_up_EXC, down_ECI), 50)
    dense_out = outputs["dense"].float()
    for name in ("grouped", "skinny"):
        row[f"{name}_rel_err"] = float((outputs[name].float() - dense_out).norm() / dense_out.norm())
    # the chosen experts' weights at the measured copy rate would be the bound; here their bytes
    row["chosen_weights_gib"] = row["weights_gib"] * row["chosen"] / E
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="glm52_mini,glm52", help="named glm52 shapes")
    p.add_argument("--tokens", default="8", help="B values (the group size G of one rank's decode)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        for B in (int(b) for b in args.tokens.split(",")):
            emit(measure(shape, B), args.out)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
