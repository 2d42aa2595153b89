"""The decode step's linears with their neighbours (norm before, silu * up or the residual after) at B rows, for
qwen36's layers: the torch form (the model's modules as the compiled step runs them: inductor's norm, silu and add
kernels around cuBLAS) against the fused Triton kernel (longstraw_kernels/linear), one CUDA graph over every
layer, each layer its own random weights (no weight is read from L2 twice). First the kernel's error at each shape
against fp64 beside the torch form's; then, per kind of linear, each launch config of --sweep over every layer;
then the whole sequence, torch against the kernel at its default configs and at each kind's fastest config of
the sweep. `bound_ms`: the weights' bytes at --rate TB/s (the lm_head's read rate on an H200).

    python scripts/bench/bench_decode_linear.py --shape qwen36_mini --tokens 8 --out linear.jsonl
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from rows import emit, graph_ms

from longstraw_cli.models.qwen36.config import NAMED_CONFIGS
from longstraw_kernels.linear import decode_linear_reference, rms_norm_one_plus
from longstraw_kernels.linear.triton_skinny import decode_linear_triton, launch_config, programmatic_launch

EPS = 1e-6


def layer_linears(cfg) -> list[dict]:
    """Each layer's four fused linears: name -> (weight, up's weight or None, norm, residual, the modules' GEMM weight)
    as the decode step runs them; the modules run gate and up as one GEMM over their concatenated weight (the
    decoder's copy; here gate and up are two views of it)."""
    C, bf16 = cfg.hidden_size, {"device": "cuda", "dtype": torch.bfloat16}
    layers = []
    for kind in cfg.layer_types:
        if kind == "linear_attention":
            value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
            mixer_in, mixer_out = cfg.conv_dim + value + 2 * cfg.linear_num_value_heads, value
        else:
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            mixer_in, mixer_out = 2 * q + 2 * kv, q
        w_in, w_out = torch.randn(mixer_in, C, **bf16) * 0.02, torch.randn(C, mixer_out, **bf16) * 0.02
        gate_up = torch.randn(2 * cfg.intermediate_size, C, **bf16) * 0.02
        down = torch.randn(C, cfg.intermediate_size, **bf16) * 0.02
        layers.append({
            f"{kind}.in": (w_in, None, True, False, w_in),
            f"{kind}.out": (w_out, None, False, True, w_out),
            "mlp.gate_up": (*gate_up.chunk(2), True, False, gate_up),
            "mlp.down": (down, None, False, True, down),
        })
    return layers


def operands(B: int, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [B, 1, K], residual [B, 1, N]) for one linear."""
    x = torch.randn(B, 1, weight.shape[1], device="cuda", dtype=torch.bfloat16)
    return x, torch.randn(B, 1, weight.shape[0], device="cuda", dtype=torch.bfloat16)


def rel(y: torch.Tensor, oracle: torch.Tensor) -> float:
    return ((y.double() - oracle).norm() / oracle.norm()).item()


def run_all(layers, inputs, norm_K, form, configs=None, only=None):
    outs = []
    for layer, layer_inputs in zip(layers, inputs):
        for name, (w, up, norm, residual, gemm) in layer.items():
            if only is not None and name != only:
                continue
            x, r = layer_inputs[name]
            kwargs = dict(up_NK=up, norm_K=norm_K if norm else None, eps=EPS)
            if form == "torch" and up is not None:  # as the modules run it: one GEMM, then silu(gate) * up
                gate, up_out = F.linear(rms_norm_one_plus(x, norm_K, EPS), gemm).chunk(2, dim=-1)
                outs.append(F.silu(gate) * up_out)
            elif form == "torch":
                outs.append(decode_linear_reference(x, w, **kwargs, residual_MN=r if residual else None))
            else:
                config = None if configs is None else configs.get(name)
                outs.append(decode_linear_triton(x, w, **kwargs, residual=r if residual else None, config=config))
    return outs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen36_mini")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--rate", type=float, default=4.09, help="TB/s for bound_ms")
    # launch_config's two (64x256x4x3 for wide N, 64x128x4x4x4 for narrow) among the others
    p.add_argument("--sweep", default="64x256x4x3,64x128x4x4x4,64x256x4x3x2,64x128x4x4x2,64x64x4x6x3,128x128x8x3,"
                                       "64x128x4x4x8,32x128x4x4x8,64x256x4x3x4,32x256x4x4x4,128x128x8x4x4,"
                                       "64x128x8x4x4",
                   help="BLOCK_N x BLOCK_K x warps x stages [x SPLIT: parts of K, 1 when left out [x PREFETCH: "
                        "elements of each weight row asked of L2 before the wait (sm90), the default's PREFETCH "
                        "when left out]]")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    cfg = NAMED_CONFIGS[args.shape]
    B = args.tokens
    layers = layer_linears(cfg)
    norm_K = torch.randn(cfg.hidden_size, device="cuda", dtype=torch.bfloat16) * 0.3
    inputs = [{name: operands(B, w) for name, (w, *_) in layer.items()} for layer in layers]
    base = {"shape": args.shape, "tokens": B, "gpu": torch.cuda.get_device_name(),
            "pdl": programmatic_launch(torch.device("cuda"))}

    # error against fp64, one layer of each kind
    seen = set()
    for layer, layer_inputs in zip(layers, inputs):
        for name, (w, up, norm, residual, _) in layer.items():
            if name in seen:
                continue
            seen.add(name)
            x, r = layer_inputs[name]
            oracle = decode_linear_reference(x.double(), w.double(), up_NK=None if up is None else up.double(),
                                             norm_K=norm_K.double() if norm else None,
                                             residual_MN=r.double() if residual else None, eps=EPS)
            kwargs = dict(up_NK=up, norm_K=norm_K if norm else None, eps=EPS)
            torch_out = decode_linear_reference(x, w, residual_MN=r if residual else None, **kwargs)
            kernel_out = decode_linear_triton(x, w, residual=r if residual else None, **kwargs)

            emit({**base, "check": name, "N": w.shape[0], "K": w.shape[1], "torch_err": rel(torch_out, oracle),
                  "kernel_err": rel(kernel_out, oracle), "config": launch_config(B, *w.shape, up is not None)},
                 args.out)

    # per kind, every config over every layer that has it
    kinds = sorted({name for layer in layers for name in layer})
    best = {}  # kind -> (ms, config) of the fastest config of --sweep
    for name in kinds:
        weights = sum(w.nbytes + (0 if up is None else up.nbytes) for layer in layers if name in layer
                      for w, up, *_ in [layer[name]])
        _, torch_ms = graph_ms(lambda n=name: run_all(layers, inputs, norm_K, "torch", only=n), 50)
        row = {**base, "kind": name, "layers": sum(name in layer for layer in layers), "weights_mb": weights / 1e6,
               "bound_ms": weights / (args.rate * 1e9), "torch_eager_ms": torch_ms}
        # the GEMMs alone (cuBLAS), without what surrounds them
        gemms = [(layer[name][-1], xs[name][0]) for layer, xs in zip(layers, inputs) if name in layer]
        _, row["cublas_ms"] = graph_ms(lambda g=gemms: [F.linear(x, w) for w, x in g], 50)
        for spec in args.sweep.split(","):
            config = tuple(int(v) for v in spec.split("x"))  # decode_linear_triton fills SPLIT and PREFETCH
            try:
                _, row[f"kernel_{spec}_ms"] = graph_ms(
                    lambda n=name, c=config: run_all(layers, inputs, norm_K, "kernel", {n: c}, only=n), 50)
            except Exception as exc:  # noqa: BLE001 - a config the compiler refuses (shared memory): noted
                row[f"kernel_{spec}_ms"] = f"{type(exc).__name__}: {str(exc)[:80]}"
                continue
            best[name] = min(best.get(name, (float("inf"), None)), (row[f"kernel_{spec}_ms"], config))
        _, row["kernel_default_ms"] = graph_ms(lambda n=name: run_all(layers, inputs, norm_K, "kernel", only=n), 50)
        emit(row, args.out)

    # the whole sequence
    weights = sum(w.nbytes for layer in layers for entry in layer.values() for w in entry[:2] if w is not None)
    compiled = torch.compile(lambda: run_all(layers, inputs, norm_K, "torch"))
    _, torch_ms = graph_ms(lambda: run_all(layers, inputs, norm_K, "torch"), 50)
    _, compiled_ms = graph_ms(compiled, 50)
    _, kernel_ms = graph_ms(lambda: run_all(layers, inputs, norm_K, "kernel"), 50)
    # and each kind at its fastest config of the sweep, beside the defaults in the same process
    configs = {name: config for name, (_, config) in best.items()}
    _, best_ms = graph_ms(lambda: run_all(layers, inputs, norm_K, "kernel", configs), 50) if configs else (0, None)
    emit({**base, "kind": "all", "layers": len(layers), "linears": sum(len(layer) for layer in layers),
          "weights_mb": weights / 1e6, "bound_ms": weights / (args.rate * 1e9), "torch_eager_ms": torch_ms,
          "torch_compiled_ms": compiled_ms, "kernel_ms": kernel_ms, "kernel_best_ms": best_ms,
          "best_configs": configs}, args.out)


if __name__ == "__main__":
    main()
