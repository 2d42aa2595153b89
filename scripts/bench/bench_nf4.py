"""NF4 weights on the GPU: one repeating unit of a model's decoder layers (qwen36: three Gated DeltaNet layers and
one attention layer), every quantisable linear of it, timed per way of multiplying by it.

Per unit, in ms (CUDA events, median of --repeats after a warm-up), scaled to the whole model in the row:
- `dequant_torchao`: torchao's get_original_weight of every linear (what the capture and replay paid per block);
- `dequant_triton`: the one-pass Triton dequantisation (longstraw_kernels.nf4);
- `linear_bf16`: F.linear of --rows rows with bf16 weights (LoRA's decode step, the baseline);
- `linear_torchao`: F.linear through torchao's NF4Tensor (dequantise, then multiply);
- `linear_nf4`: `longstraw_cli.quantize.linear` (the Triton dequantisation, then F.linear): QLoRA's decode step;
and the bytes each moves, as a rate. The kernel's exactness is tested in tests/kernels/test_nf4.py.

    python scripts/bench/bench_nf4.py --model qwen36 --rows 8
"""

from __future__ import annotations

import argparse
import datetime

import torch
from rows import emit, time_ms

from longstraw_cli.base_weights import candidate_linears
from longstraw_cli.models import build_model
from longstraw_cli.quantize import linear, nf4_parts, quantizable, scaler_block_size, torchao_nf4
from longstraw_kernels.nf4 import triton_nf4

# (64-blocks a program, warps) of the dequantisation
SWEEP = [(16, 4), (64, 4), (64, 8), (128, 8), (256, 8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen36")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--unit", type=int, default=4, help="decoder layers in the repeating unit")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also time the dequantisation's other tile shapes")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    nf4 = torchao_nf4()
    meta = build_model(args.model, dtype=torch.bfloat16, device="meta")
    layers = meta.model.layers
    shapes = [tuple(linear.weight.shape) for layer in layers[:args.unit]
              for linear in candidate_linears(layer).values() if quantizable(linear)]
    g = torch.Generator(device="cuda").manual_seed(0)
    dense = [(torch.randn(shape, generator=g, device="cuda") * 0.02).to(torch.bfloat16) for shape in shapes]
    quantised = [nf4.to_nf4(w, 64, scaler_block_size(w.numel())) for w in dense]
    parts = [nf4_parts(q) for q in quantised]
    xs = {k: torch.randn(args.rows, k, generator=g, device="cuda").to(torch.bfloat16) for _, k in shapes}
    weights = sum(w.numel() for w in dense)

    runs = {
        "dequant_torchao": lambda: [q.get_original_weight() for q in quantised],
        "dequant_triton": lambda: [triton_nf4.dequantize_triton(p) for p in parts],
        "linear_bf16": lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in dense],
        "linear_torchao": lambda: [torch.nn.functional.linear(xs[q.shape[1]], q) for q in quantised],
        "linear_nf4": lambda: [linear(xs[q.shape[1]], q) for q in quantised],
    }
    # bytes each way moves per unit: bf16 weights 2 a weight; NF4 codes half a byte plus a scaler byte per 64;
    # dequantising writes 2 more, and the product then reads them
    nf4_bytes = weights * (0.5 + 1 / 64)
    moved = {"dequant_torchao": None, "dequant_triton": nf4_bytes + 2 * weights, "linear_bf16": 2 * weights,
             "linear_torchao": None, "linear_nf4": nf4_bytes + 4 * weights}
    scale = len(layers) / args.unit
    row = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "model": args.model,
           "rows": args.rows, "unit_layers": args.unit, "unit_weights": weights, "whole_model_factor": scale}
    for name, fn in runs.items():
        ms = time_ms(fn, args.repeats, warmup=2)
        row[f"{name}_ms_unit"] = round(ms, 4)
        row[f"{name}_ms_model"] = round(ms * scale, 2)
        if moved[name]:
            row[f"{name}_TBps"] = round(moved[name] / ms / 1e9, 3)
    if args.sweep:
        for config in SWEEP:
            ms = time_ms(lambda c=config: [triton_nf4.dequantize_triton(p, c) for p in parts], args.repeats, warmup=2)
            row[f"dequant_triton_{config[0]}x{config[1]}_ms_model"] = round(ms * scale, 2)
    emit(row, args.out)


if __name__ == "__main__":
    main()
