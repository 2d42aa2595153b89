"""Native decode per step, against its memory-bandwidth bound and against HF transformers' cached decode.

For each model and prompt length: build the model (random weights, bf16, CUDA), capture a random prompt, then
time `rollout.native.generate` for --tokens tokens with G responses, as a CUDA graph and eagerly (ms per decode
step = wall time / steps, synchronised). The bound is the bytes one step must read (every weight a step touches
once, the prompt's pages once for all G responses, qwen36's response keys as filled on average over --tokens
steps; glm52: its index keys, routed experts as read by the dense decode path) over the device's measured copy
bandwidth. The baseline (qwen36 only) is what a user would run:
HF `Qwen3_5ForCausalLM` of the same shape with fla's kernels, prefilled with `logits_to_keep=1`, then its
cached decode one token at a time at batch 1. One JSON row per measurement goes to --out.

    python scripts/bench/bench_decode.py --model qwen36_mini --prompt 65536 262144 --group 8 --tokens 128
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from rows import emit  # noqa: E402

from longstraw_cli.models import build_model  # noqa: E402
from longstraw_cli.rollout.native import NativeConfig, SamplingConfig, generate  # noqa: E402

GB = 1e9


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy rate in bytes/s (read + write counted)."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 10 * 2 * a.numel() / (time.perf_counter() - start)


def step_bytes(model, resident) -> int:
    """Bytes a decode step must read at least: weights (the embedding table only for the sampled rows), prompt
    pages (qwen36: all K/V; glm52: index keys of full layers and the selected latent rows)."""
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if model.family == "qwen36":
        pages = sum(t.numel() * t.element_size() for t in resident.tensors())
    else:
        cfg = model.config
        pages = sum(0 if p.index_PI is None else p.index_PI.numel() * p.index_PI.element_size()
                    for p in resident.layers)
        pages += len(resident.layers) * min(cfg.index_topk, resident.num_tokens) * (cfg.kv_lora_rank
                                                                                   + cfg.qk_rope_head_dim) * 2
    return weights + pages


def response_bytes(model, group: int, tokens: int) -> int:
    """Bytes of the responses' own keys a step reads, averaged over `tokens` steps (a step reads the filled slots):
    qwen36's K/V of each attention layer. glm52's (index keys and selected latent rows of its own tokens) are
    not counted: its top-k rows are counted with the pages."""
    if model.family != "qwen36":
        return 0
    cfg = model.config
    layers = sum(layer.is_attention for layer in model.model.layers)
    itemsize = model.lm_head.weight.element_size()  # the response buffers hold the model's dtype
    return layers * 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize * group * (tokens + 1) // 2


def time_generate(model, resident, group: int, tokens: int, graph: bool) -> tuple[float, int]:
    cfg = SamplingConfig(max_new_tokens=tokens)
    native = NativeConfig(cuda_graph=graph, stop_check_every=tokens)
    # warm-up (compilation, graph capture, Triton kernels) on at most 1,024 tokens: the compiled step serves every
    # capacity, a longer response only captures the graph again as it grows (as the trainer's rollouts do)
    generate(model, resident, group, SamplingConfig(max_new_tokens=min(tokens, 1024)),
             torch.Generator("cuda").manual_seed(1), native)
    torch.cuda.synchronize()
    start = time.perf_counter()
    rollout = generate(model, resident, group, cfg, torch.Generator("cuda").manual_seed(0), native)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / rollout.decode_steps, rollout.decode_steps


def hf_decode(model, prompt: torch.Tensor, tokens: int) -> dict:
    """HF's cached decode of the same shape: prefill (logits_to_keep=1), then one token at a time, batch 1."""
    import transformers

    from longstraw_cli.models.qwen36.hf import config_to_hf

    hf_cfg = config_to_hf(model.config)
    hf_cfg.pop("architectures", None)
    hf_cfg.pop("model_type", None)
    cfg = transformers.Qwen3_5TextConfig(**hf_cfg)
    with torch.device("cuda"):
        hf = transformers.Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()
    torch.cuda.synchronize()
    with torch.no_grad():
        start = time.perf_counter()
        out = hf(prompt[None], use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - start
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(tokens):
            start = time.perf_counter()
            out = hf(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    del hf, cache, out
    torch.cuda.empty_cache()
    times.sort()
    return {"hf_prefill_s": prefill, "hf_decode_ms": 1e3 * times[len(times) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen36_mini")
    parser.add_argument("--prompt", type=int, nargs="+", default=[65536, 262144])
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16384)
    parser.add_argument("--hf", action="store_true", help="also time HF transformers' cached decode (qwen36)")
    parser.add_argument("--eager", action="store_true", help="also time the decode step without a CUDA graph")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    model = build_model(args.model, dtype=torch.bfloat16, device="cuda", seed=0)
    for P in args.prompt:
        prompt = torch.randint(0, 250, (P,), device="cuda", generator=torch.Generator("cuda").manual_seed(P))
        start = time.perf_counter()
        resident = model.capture(prompt, block_size=args.block_size)
        torch.cuda.synchronize()
        row = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "model": args.model, "prompt": P, "group": args.group,
               "capture_s": time.perf_counter() - start, "copy_bandwidth_gbs": bandwidth / GB}
        nbytes = step_bytes(model, resident) + response_bytes(model, args.group, args.tokens)
        row["step_bytes_gb"] = nbytes / GB
        row["bound_ms"] = 1e3 * nbytes / bandwidth
        graph_s, row["steps"] = time_generate(model, resident, args.group, args.tokens, graph=True)
        row["graph_ms"] = 1e3 * graph_s
        row["graph_over_bound"] = row["graph_ms"] / row["bound_ms"]
        if args.eager:
            row["eager_ms"] = 1e3 * time_generate(model, resident, args.group, args.tokens, graph=False)[0]
        del resident
        torch.cuda.empty_cache()
        if args.hf and model.family == "qwen36":
            row.update(hf_decode(model, prompt, min(args.tokens, 32)))
            # tokens per second: G per step for ours, one per step for HF at batch 1
            row["throughput_over_hf"] = (args.group / row["graph_ms"]) / (1 / row["hf_decode_ms"])
        emit(row, args.out)


if __name__ == "__main__":
    main()
