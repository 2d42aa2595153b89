"""What a user would run instead for the exact GRPO gradient: HF transformers' `Qwen3_5ForCausalLM` (fla's kernels
where installed), gradient checkpointing, `logits_to_keep`, one response at a time over prompt + response.

Per response: one forward over the whole sequence with autograd (checkpointed per decoder layer), log-probs of the
response tokens only (`logits_to_keep=R + 1`), a policy-gradient loss, backward. The gradient is the exact one
(nothing detached), what `capture.gradient=exact` computes. Times are CUDA-synchronised; the peak is
`torch.cuda.max_memory_allocated` over the response. A short warm-up sequence runs first (Triton JIT). One JSON
row per prompt length to stdout and --out; a prompt that does not fit is recorded as such (the OOM is caught),
and so is a backward that refuses to run (fla's gated backward on Hopper with Triton < 3.7.1: then nothing is
timed, and this machine cannot measure the baseline with fla).

    python scripts/bench/bench_hf_train.py --model qwen36_mini --prompt 65536 262144 --response 1024
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
from rows import emit

GIB = 2**30


def hf_model(name: str):
    import transformers

    from longstraw_cli.models.qwen36.config import named_config
    from longstraw_cli.models.qwen36.hf import config_to_hf

    hf_cfg = config_to_hf(named_config(name))
    hf_cfg.pop("architectures", None)
    hf_cfg.pop("model_type", None)
    with torch.device("cuda"):
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**hf_cfg)).to(torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.train()
    return model


def one_response(model, prompt_len: int, response_len: int, seed: int) -> dict:
    g = torch.Generator("cuda").manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, prompt_len + response_len), device="cuda", generator=g)
    advantages = torch.randn(response_len, device="cuda", generator=g)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    # logits of the positions that predict the response: the last R + 1 of the sequence, the final one unused
    logits = model(ids, logits_to_keep=response_len + 1, use_cache=False).logits[0, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[0, prompt_len:, None])[:, 0]
    loss = -(advantages * logp).mean()
    loss.backward()
    torch.cuda.synchronize()
    out = {"seconds": time.perf_counter() - start, "peak_gib": torch.cuda.max_memory_allocated() / GIB}
    model.zero_grad(set_to_none=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen36_mini")
    parser.add_argument("--prompt", type=int, nargs="+", required=True)
    parser.add_argument("--response", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=4096, help="tokens of the warm-up sequence")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = hf_model(args.model)
    for prompt in [args.warmup, *args.prompt]:
        row = {"bench": "hf_train", "model": args.model, "prompt": prompt, "response": args.response,
               "warmup": prompt == args.warmup, "date": datetime.date.today().isoformat(),
               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
        try:
            row.update(one_response(model, prompt, min(args.response, prompt), seed=1))
        except torch.OutOfMemoryError as e:
            row.update(error="out of memory", detail=str(e).splitlines()[0])
        except RuntimeError as e:
            # fla's gated backward refuses Hopper with Triton >= 3.4, < 3.7.1 (fla issue 640)
            row.update(error="runtime error", detail=str(e).splitlines()[0])
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        emit(row, args.out)
        if "error" in row and prompt == args.warmup:
            return


if __name__ == "__main__":
    main()
