"""`longstraw plan`: the memory of one LongStraw transaction per rank, from the config alone (no model is built).

Every family plans the same phases (the family's hook, FamilySpec.plan, says what each holds):

    capture = weights + optimizer + resident + one capture block's activations
    score   = weights + optimizer + resident + one graph-free scoring batch (none where nothing is scored: the
              native rollout's log-probs serve as the old ones, or algo=sft reads none, and algo.kl_coef is 0)
    replay  = weights + optimizer + grads + resident + one response graph + the logits chunk's backward
    step    = weights + optimizer + grads + resident + AdamW's foreach temporary
    prompt  = exact mode's reverse walk (capture.gradient=exact)
    drift   = the reuse probe (capture.reuse_steps > 1)
    rollout = weights + optimizer + resident + the decode's buffers (R response slots at worst, and the old copy of
              one buffer while the last growth copies it) + one decode step (none without a decode: responses
              given by rollout=data or drawn by rollout=synthetic)
    peak    = the largest phase

`plan()` checks the settings once (the training config's own refusals) and calls the family's hook with a `Run`;
`report()` prints one table row per prompt length, every phase, the family's notes, the longest prompt that fits
per placement and the longest response that fits beside the first row's prompt. The command line is
`longstraw plan [overrides]` (cli.py), with the training config's keys and defaults; `python -m longstraw_cli.plan`
runs the same command.
"""

from __future__ import annotations

import importlib
import sys

from longstraw_cli.lora import LoraConfig
from longstraw_cli.plan.common import GIB, KERNELS, Run, itemsize
from longstraw_cli.quantize import dtype_refusal
from longstraw_cli.resident.gradient import check_gradient_mode
from longstraw_cli.resident.offload import OFFLOAD_NAMES, offload_refusal
from longstraw_cli.rollout.native import NativeConfig

__all__ = ["GIB", "KERNELS", "main", "max_prompt_tokens", "max_response_tokens", "plan", "report",
           "whole_response_advice"]


def _family(model_name_or_cfg):
    """(family spec, model config) of a named config or a family's config object."""
    from longstraw_cli.models import families, family_of

    if isinstance(model_name_or_cfg, str):
        spec = family_of(model_name_or_cfg)
        return spec, spec.named_config(model_name_or_cfg)
    for spec in families():
        if isinstance(model_name_or_cfg, type(next(iter(spec.configs.values())))):
            return spec, model_name_or_cfg
    names = sorted(name for spec in families() for name in spec.configs)
    raise ValueError(f"model must be a name in {names} or a family's config, got {model_name_or_cfg!r}")


def _hook(spec):
    """The family's plan function, or a one-line refusal naming the families planned."""
    from longstraw_cli.models import families

    if spec.plan is None:
        planned = [s for s in families() if s.plan]
        raise ValueError(f"the memory plan models the {' / '.join(s.name for s in planned)} families, not {spec.name}; "
                         f"valid: {sorted(name for s in planned for name in s.configs)}")
    module, _, function = spec.plan.partition(":")
    return getattr(importlib.import_module(module), function)


def plan(model_name_or_cfg, *, cp: int = 1, ep: int = 1, prompt_tokens: int, group_size: int, response_tokens: int,
         dtype: str = "bfloat16", lora_rank: int = 0, gpu_mem_gib: float = 139.0, block_size: int = 8192,
         score_batch: int = 8, logprob_chunk: int = 1024, attention_block: int = 1024,
         moment_dtype: str | None = None, kernels: str = "auto", gradient: str = "response_only",
         walk_checkpoint: bool = False, reuse: bool = False, probe_tokens: int = 1024, quantize: str = "none",
         offload: str = "none", host_mem_gib: float = 128.0, offload_copy_gib: float | str = "auto",
         replay_routing: bool | str = "auto", replay_block: int = 0,
         response_chunk: int = NativeConfig.response_chunk, scoring: bool = True, decode: bool = True) -> dict:
    """Per-rank bytes of one transaction by component and by phase, with `peak`, `budget` and `fits`.
    kernels: "gpu" (the CUDA kernels), "reference" (the torch kernels), "auto": gpu for bf16/fp16, where the
    models dispatch to them on CUDA, reference otherwise. gradient: response_only | exact. reuse: capture reuse
    (capture.reuse_steps > 1). quantize: "none" | "nf4" (lora.quantize; needs lora_rank > 0).
    offload_copy_gib (rollout.native.offload_copy_gib, offload="cpu"): the rollout's copies of host pages, whole
    layers, into the GPU memory the other phases leave free ("auto": what gpu_mem_gib holds with 10% spare). The
    offloaded rollout's figure (`rollout`) is not a phase of `peak` where a family plans it apart: its copies take
    only memory that is free, so they never decide whether a prompt fits. replay_routing (rollout.replay_routing):
    whether the family's routing records are held (auto: where the family routes). replay_block
    (capture.replay_block): the response replayed and scored in blocks of that many tokens (0: whole). scoring:
    whether the score phase runs a forward (`longstraw plan` sets it from algo.kl_coef > 0 or rollout=vllm); without
    one the phase holds no activations. decode: whether a decode samples the responses (rollout=native | vllm: the
    rollout phase); `longstraw plan` sets it false for rollout=data | synthetic."""
    spec, cfg = _family(model_name_or_cfg)
    check_gradient_mode(gradient)
    refused = offload_refusal(offload, gradient=gradient)
    if refused:
        raise ValueError(refused)
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}; valid: {list(KERNELS)}")
    if kernels == "auto":
        kernels = "gpu" if dtype in ("bfloat16", "float16") else "reference"
    for name, value in (("cp", cp), ("ep", ep), ("prompt_tokens", prompt_tokens), ("group_size", group_size),
                        ("response_tokens", response_tokens), ("block_size", block_size),
                        ("score_batch", score_batch), ("logprob_chunk", logprob_chunk),
                        ("attention_block", attention_block), ("response_chunk", response_chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if isinstance(replay_block, bool) or not isinstance(replay_block, int) or replay_block < 0:
        raise ValueError(f"replay_block must be an int >= 0 (0: whole responses), got {replay_block!r}")
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
        raise ValueError(f"lora_rank must be an int >= 0 (0 = full fine-tuning), got {lora_rank!r}")
    if ep > 1 and spec.expert_parallel is None:
        raise ValueError(f"ep={ep}: model family {spec.name!r} has no routed experts to split; valid: ep=1")
    if cp % ep:
        raise ValueError(f"ep={ep} must divide cp={cp} (an EP group lies within a CP group); valid ep: "
                         f"{[n for n in range(1, cp + 1) if cp % n == 0]}")
    # the training config's own refusals (lora.LoraConfig, config._check_quantize)
    LoraConfig(rank=lora_rank, quantize=quantize)
    refused = dtype_refusal(quantize, dtype)
    if refused:
        raise ValueError(refused)
    run = Run(cp=cp, ep=ep, prompt_tokens=prompt_tokens, group_size=group_size, response_tokens=response_tokens,
              dtype=dtype, lora_rank=lora_rank, block_size=block_size, score_batch=score_batch,
              logprob_chunk=logprob_chunk, attention_block=attention_block, moment_dtype=moment_dtype,
              kernels=kernels, gradient=gradient, walk_checkpoint=walk_checkpoint, reuse=reuse,
              probe_tokens=probe_tokens, quantize=quantize, offload=offload, gpu_mem_gib=gpu_mem_gib,
              host_mem_gib=host_mem_gib, offload_copy_gib=offload_copy_gib, replay_routing=replay_routing,
              replay_block=replay_block, response_chunk=response_chunk, scoring=scoring, decode=decode)
    for value in (dtype, moment_dtype or dtype):
        itemsize(value)
    out = _hook(spec)(cfg, run)
    peak = max(out["phases"].values())
    budget, host_budget = run.budget, int(host_mem_gib * GIB)
    return {
        "model": model_name_or_cfg if isinstance(model_name_or_cfg, str) else "custom", "family": spec.name,
        "cp": cp, "ep": ep, "prompt_tokens": prompt_tokens, "group_size": group_size,
        "response_tokens": response_tokens, "dtype": dtype, "lora_rank": lora_rank, "block_size": block_size,
        "score_batch": score_batch, "kernels": kernels, "gradient": gradient, "walk_checkpoint": walk_checkpoint,
        "quantize": quantize, "offload": offload, "offload_copy_gib": offload_copy_gib, "replay_block": replay_block,
        "scoring": scoring, "decode": decode, **out, "peak": peak, "budget": budget, "host_budget": host_budget,
        "fits": peak <= budget and out["host"] + out.get("routing_records_host", 0) <= host_budget,
    }


def whole_response_advice(phase: str | None, replay_block: int, response_tokens: int) -> str | None:
    """What to set where memory runs out (or is planned to) in `phase`: the replay and the scoring of whole
    responses (capture.replay_block 0) hold a response's whole graph or activations, which capture.replay_block=N
    bounds by a block. None for other phases, or with blocks already."""
    if phase in ("replay", "score") and replay_block == 0:
        return (f"whole responses of response_tokens={response_tokens}: capture.replay_block=N replays and scores "
                "them in blocks of N tokens")
    return None


def max_prompt_tokens(model_name_or_cfg, *, gpu_mem_gib: float = 139.0, limit: int = 2**34, **kwargs) -> int:
    """The longest prompt whose planned peak fits in gpu_mem_gib (0 if not even a 2-token prompt fits)."""
    def fits(n: int) -> bool:
        return plan(model_name_or_cfg, prompt_tokens=n, gpu_mem_gib=gpu_mem_gib, **kwargs)["fits"]

    if not fits(2):
        return 0
    lo, hi = 2, 4
    while hi < limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi >= limit and fits(limit):
        return limit
    # invariant: fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def max_response_tokens(model_name_or_cfg, *, prompt_tokens: int, gpu_mem_gib: float = 139.0, limit: int = 2**24,
                        **kwargs) -> int:
    """The longest response (response_tokens) whose planned peak fits beside `prompt_tokens` (0: none)."""
    kwargs.pop("response_tokens", None)

    def fits(n: int) -> bool:
        return plan(model_name_or_cfg, prompt_tokens=prompt_tokens, response_tokens=n, gpu_mem_gib=gpu_mem_gib,
                    **kwargs)["fits"]

    if limit < 1 or not fits(1):
        return 0
    lo, hi = 1, 2
    while hi < limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi >= limit:
        return limit if fits(limit) else _bisect(fits, lo, limit)
    return _bisect(fits, lo, hi)


def _bisect(fits, lo: int, hi: int) -> int:
    """The largest n in [lo, hi) with fits(n), given fits(lo) and not fits(hi)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


COLUMNS = {"weights": "weights", "grads": "grads", "optimizer": "optim", "resident": "resident",
           "capture_activations": "capt_act", "score_activations": "score_act", "response_graph": "graph",
           "replay_transient": "repl_tr"}


def report(cfg, title: str, prompts: list[int], **common) -> int:
    """Print the per-rank plan of each prompt length (a row of components, then every phase and the family's
    notes) and the longest prompt that fits per placement; 2 on a bad value."""
    try:
        plans = [plan(cfg, prompt_tokens=prompt, **common) for prompt in prompts]
        # the trainer refuses a prompt past the model's positions (less the response's), whatever memory allows
        positions = cfg.max_position_embeddings
        cap = positions - common["response_tokens"]
        longest = max_prompt_tokens(cfg, limit=cap, **common)
        # the placements this run may take (offload is refused with exact gradients)
        placements = [o for o in OFFLOAD_NAMES if not offload_refusal(
            o, gradient=common.get("gradient", "response_only"))]
        per_placement = {o: max_prompt_tokens(cfg, limit=cap, **{**common, "offload": o}) for o in placements}
    except ValueError as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return 2
    ep = f", ep={common['ep']}" if common.get("ep", 1) > 1 else ""
    print(f"{title} ({cfg.num_hidden_layers} layers), cp={common['cp']}{ep}, G={common['group_size']}, "
          f"R={common['response_tokens']}, {common['dtype']}, lora_rank={common['lora_rank']}, "
          f"quantize={common.get('quantize', 'none')}, block={common['block_size']}, "
          f"plan_kernels={plans[0]['kernels']}, gradient={common.get('gradient', 'response_only')}"
          f"{', walk_checkpoint' if common.get('walk_checkpoint') else ''}"
          f"{', replay_block=' + str(common['replay_block']) if common.get('replay_block') else ''}"
          f"{'' if common.get('decode', True) else ', no decode (responses given)'}; GiB per rank")
    print(f"{'prompt':>9} " + " ".join(f"{c:>9}" for c in COLUMNS.values())
          + f" {'bound':>9} {'peak':>9} {'phase':>8}  fits")
    for p in plans:
        phase = max(p["phases"], key=p["phases"].get)
        print(f"{p['prompt_tokens']:>9} " + " ".join(f"{p[c] / GIB:>9.2f}" for c in COLUMNS)
              + f" {p['bound'] / GIB:>9.2f} {p['peak'] / GIB:>9.2f} {phase:>8}  {'yes' if p['fits'] else 'NO'}")
    for p in plans:
        print(f"{p['prompt_tokens']:>9} phases: " + ", ".join(f"{name} {nbytes / GIB:.2f}"
                                                             for name, nbytes in p["phases"].items()))
        for note in p["notes"]:
            print(f"{p['prompt_tokens']:>9} {note}")
    for p in plans:
        if p["prompt_tokens"] > cap:
            print(f"{p['prompt_tokens']:>9} is past the model's positions: with response_tokens="
                  f"{common['response_tokens']} its {positions} positions leave room for {cap} (longstraw train "
                  f"refuses it)")
    capped = (f" (the model's {positions} positions less the response; memory allows more)"
              if longest == cap and plan(cfg, prompt_tokens=cap + 1, **common)["fits"] else "")
    print(f"longest prompt that fits in {common['gpu_mem_gib']:g} GiB: {longest} tokens ({longest / 2**20:.2f}M)"
          + capped)
    # and the other way round: the longest response beside the first row's prompt
    first = plans[0]["prompt_tokens"]
    reply = max_response_tokens(cfg, prompt_tokens=first, limit=positions - first, **common)
    print(f"longest response that fits beside a {first}-token prompt: {reply} tokens"
          + (f" (replay_block={common['replay_block']})" if common.get("replay_block") else " (whole replay)"))
    host_limit = f"{common.get('host_mem_gib', 128.0):g} GiB host"
    print("longest prompt per placement: " + ", ".join(
        f"offload={o}: {n} tokens ({n / 2**20:.2f}M)" + (f", {host_limit}" if o == "cpu" else "")
        for o, n in per_placement.items()))
    return 0

