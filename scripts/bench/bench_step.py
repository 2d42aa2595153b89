"""One GRPO optimizer step, LongStraw against a full-graph baseline, on the same model and the same lengths.

For each (prompt P, group G) and a fixed response length R, with random token ids (no rollout, no reward model):
  longstraw  `Transaction.run`: capture the prompt once without autograd (blocks of --block-size), score the G
             responses graph-free, replay each response with autograd + backward, finalize, one AdamW step.
  naive      what TRL/verl-style trainers do at micro-batch 1: for each response, `cat(prompt, response)` through
             the model with autograd, activation checkpointing around every decoder layer, response log-probs
             in chunks, the same GRPO loss with old = detached log-probs (ratio 1), backward; then one step.
Memory is the CUDA allocator's peak per phase (reset and synchronized around each phase); on CPU the process's
peak RSS stands in, with the project's own accounting (resident state + autograd graph). One JSON row per
(method, P, G) goes to --out as soon as it is measured.

Simplifications: one prompt per step, equal-length responses, KL off (no reference pass), the baseline gets its
old log-probs for free (a real trainer would score the G sequences once more without a graph).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import sys
import time
import traceback
import warnings

# Before CUDA initialises: long prompts allocate and free GiB-sized blocks; segments that can grow keep the
# allocator from failing on fragmentation (a user's own setting wins).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from longstraw_cli.distributed.strategy import LocalStrategy  # noqa: E402
from longstraw_cli.lora import LoraConfig, apply_lora  # noqa: E402
from longstraw_cli.models import MODEL_NAMES, build_model, family_of  # noqa: E402
from longstraw_cli.models.logprobs import token_logprobs  # noqa: E402
from longstraw_cli.plan import plan  # noqa: E402
from longstraw_cli.rl.advantages import get_advantage  # noqa: E402
from longstraw_cli.rl.losses import GroupShape, LossConfig, response_loss  # noqa: E402
from longstraw_cli.telemetry.memory import PhaseClock, proc_bytes  # noqa: E402
from longstraw_cli.transaction import Transaction, TransactionConfig  # noqa: E402
from longstraw_kernels import use_kernels  # noqa: E402
from longstraw_kernels.attention.flash import forward_backend  # noqa: E402
from longstraw_kernels.attention.reference import replay_attention as reference_attention  # noqa: E402
from longstraw_kernels.gdn import gdn_chunked  # noqa: E402
from longstraw_kernels.gdn.fla_gpu import fla_forward  # noqa: E402

# both methods clip to the trainer's default optim.max_grad_norm
MAX_GRAD_NORM = 1.0

GIB = 2**30
METHODS = ("longstraw", "naive")
DTYPES = ("float32", "bfloat16", "float16")


# -- memory on either device ----------------------------------------------------------------------------------
class RssPeak:
    """Peak resident set size of this process since the last reset (Linux: VmHWM, reset via clear_refs)."""

    def reset(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    @staticmethod
    def current() -> int | None:
        return proc_bytes("/proc/self/status", "VmRSS")

    def read(self) -> int:
        peak = proc_bytes("/proc/self/status", "VmHWM")
        if peak is not None:
            return peak
        # the lifetime peak: kilobytes on Linux, bytes on macOS
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if platform.system() == "Darwin" else peak * 1024


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(error: BaseException) -> bool:
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    # cuBLAS/cuSOLVER report a failed workspace allocation as a plain RuntimeError
    text = str(error)
    return isinstance(error, RuntimeError) and ("out of memory" in text or "ALLOC_FAILED" in text)


def release(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Back to weights + optimizer state after a method ran (or failed half-way)."""
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# -- the two methods ------------------------------------------------------------------------------------------
def _layer_hidden(layer: torch.nn.Module, x_BTC: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
    # the layer returns (x, carry); qwen36's carry is None
    return layer(x_BTC, positions_T)[0]


def _glm52_layer(layer: torch.nn.Module, x_BTC: torch.Tensor, positions_T: torch.Tensor, prev_idx):
    # HF's full-sequence route: expanded per-head K/V, the DSA top-k as an attention mask; -> (x, top-k indices)
    return layer(x_BTC, positions_T, prev_idx)


def full_graph_logprobs(model, prompt_ids: torch.Tensor, response_ids: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """log p(response | prompt) through the whole prompt + response with autograd, one checkpoint per layer."""
    ids_BT = torch.cat([prompt_ids, response_ids])[None]
    positions_T = torch.arange(ids_BT.shape[1], device=ids_BT.device)
    x_BTC, idx = model.model.embed_tokens(ids_BT), None
    for layer in model.model.layers:
        if model.family == "glm52":
            # shared-indexer layers reuse the previous full layer's selection, so it passes between checkpoints
            x_BTC, idx = checkpoint(_glm52_layer, layer, x_BTC, positions_T, idx, use_reentrant=False)
        else:
            x_BTC = checkpoint(_layer_hidden, layer, x_BTC, positions_T, use_reentrant=False)
    # hidden states at positions P-1 .. P+R-2 predict response tokens 0 .. R-1
    start = prompt_ids.numel() - 1
    h_BRC = model.model.norm(x_BTC[:, start : start + response_ids.numel()])
    return token_logprobs(h_BRC, model.lm_head.weight, response_ids[None], chunk_size)[0]


class Naive:
    def __init__(self, model, optimizer, loss_cfg: LossConfig, cfg: TransactionConfig):
        self.model, self.optimizer, self.loss_cfg, self.cfg = model, optimizer, loss_cfg, cfg
        self.params = [p for p in model.parameters() if p.requires_grad]

    def run(self, prompt_ids, responses, rewards, limit: int | None = None) -> dict:
        """`limit`: replay only the first `limit` responses (each costs the same: one full prompt + response
        pass); the caller extrapolates the step time to all G and says so."""
        clock = PhaseClock(prompt_ids.device)
        self.optimizer.zero_grad(set_to_none=True)
        group = GroupShape.from_lengths([len(r) for r in responses])
        advantages = get_advantage(self.cfg.advantage)(rewards.double()).tolist()
        with clock.phase("fwd_bwd"):
            for response, advantage in list(zip(responses, advantages))[:limit]:
                logp = full_graph_logprobs(self.model, prompt_ids, response, self.cfg.logprob_chunk)
                loss, _ = response_loss(self.loss_cfg, logp, logp.detach(), advantage, group)
                loss.backward()
                del logp, loss
        with clock.phase("step"):
            torch.nn.utils.clip_grad_norm_(self.params, MAX_GRAD_NORM)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return {"seconds": clock.seconds, "cuda_peak_bytes": clock.cuda_peak_bytes}


def run_longstraw(transaction: Transaction, prompt_ids, responses, rewards) -> dict:
    clock = PhaseClock(prompt_ids.device)
    with clock.phase("capture"):
        resident = transaction.capture(prompt_ids)
    result = transaction.run(prompt_ids, responses, rewards, resident, clock=clock)
    return {
        "seconds": result.seconds, "cuda_peak_bytes": result.cuda_peak_bytes,
        "resident_bytes": result.resident_bytes["total"], "resident_detail": result.resident_bytes,
        "graph_peak_bytes": result.graph_peak_bytes, "graph_live_bytes_after": result.graph_live_bytes_after,
        "accounted_peak_bytes": result.accounted_peak_bytes, "loss": result.stats.get("loss"),
        "grad_norm": result.stats.get("grad_norm"),
    }


# -- set-up ---------------------------------------------------------------------------------------------------
def make_inputs(vocab_size: int, prompt_tokens: int, group_size: int, response_tokens: int, seed: int,
                device: torch.device):
    """The same ids for both methods: drawn on the CPU from a seed of (seed, P, G), then moved."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + prompt_tokens * 31 + group_size)
    prompt = torch.randint(0, vocab_size, (prompt_tokens,), generator=g).to(device)
    responses = [torch.randint(0, vocab_size, (response_tokens,), generator=g).to(device) for _ in range(group_size)]
    rewards = torch.randn(group_size, generator=g, dtype=torch.float64).to(device)
    return prompt, responses, rewards


def static_bytes(model, optimizer) -> dict[str, int]:
    params = {p.data_ptr(): p for p in model.parameters()}.values()
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    # AdamW's moments; its 0-dim `step` counters live on the CPU
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"weights_bytes": weights, "grads_bytes": grads, "optimizer_bytes": state}


def sdpa_backend(model, device: torch.device, dtype: torch.dtype) -> str:
    """The first fused SDPA backend that runs the baseline's attention (causal, GQA, this head dim), fwd + bwd.
    Without one, SDPA falls back to the math backend, which materialises [heads, T, T] scores."""
    if device.type != "cuda":
        return "cpu"
    if model.family == "glm52":
        return "masked SDPA (HF's DSA route: the top-k as a [T, T] mask)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = model.config
    q = torch.randn(1, cfg.num_attention_heads, 256, cfg.head_dim, device=device, dtype=dtype, requires_grad=True)
    kv = torch.randn(1, cfg.num_key_value_heads, 256, cfg.head_dim, device=device, dtype=dtype)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with warnings.catch_warnings(), sdpa_kernel(backend):
                warnings.simplefilter("ignore")
                out = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
                out.sum().backward()
            return backend.name
        except (RuntimeError, NotImplementedError):
            continue
    return "MATH (no fused backend: [heads, T, T] scores)"


# -- one measurement ------------------------------------------------------------------------------------------
def measure(method: str, bench: dict, prompt_tokens: int, group_size: int, args) -> dict:
    model, optimizer, device = bench["model"], bench["optimizer"], bench["device"]
    prompt, responses, rewards = make_inputs(model.config.vocab_size, prompt_tokens, group_size, args.response,
                                             args.seed, device)
    row = {"method": method, "prompt_tokens": prompt_tokens, "group_size": group_size,
           "response_tokens": args.response, "tokens": prompt_tokens + group_size * args.response}
    release(model, optimizer, device)
    if device.type == "cuda":
        row["cuda_static_bytes"] = torch.cuda.memory_allocated(device)
    rss = RssPeak()
    rss.reset()
    if device.type != "cuda":
        row["rss_start_bytes"] = rss.current()
    synchronize(device)
    start = time.perf_counter()
    try:
        if method == "longstraw":
            out = run_longstraw(bench["transaction"], prompt, responses, rewards)
        else:
            out = bench["naive"].run(prompt, responses, rewards, limit=args.naive_responses)
        synchronize(device)
        row["status"] = "ok"
        row.update(out)
    except Exception as error:  # noqa: BLE001 - one failed configuration must not end the sweep
        if is_oom(error):
            row["status"] = "OOM"
            row["error"] = str(error).splitlines()[0] if str(error) else "OutOfMemoryError"
        else:
            row["status"] = "error"
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            traceback.print_exc()
    row["wall_seconds"] = time.perf_counter() - start
    del prompt, responses, rewards
    release(model, optimizer, device)
    if device.type != "cuda":
        row["rss_peak_bytes"] = rss.read()
    if row["status"] != "ok":
        return row

    if method == "naive" and args.naive_responses and args.naive_responses < group_size:
        # measured on the first responses only; every response repeats the same prompt + response pass
        row["naive_measured_responses"] = args.naive_responses
        row["fwd_bwd_measured_seconds"] = row["seconds"]["fwd_bwd"]
        row["seconds"]["fwd_bwd"] *= group_size / args.naive_responses
        row["extrapolated"] = True
    row["step_seconds"] = sum(row["seconds"].values())
    row["tokens_per_second"] = row["tokens"] / row["step_seconds"] if row["step_seconds"] > 0 else None
    row.update(static_bytes(model, optimizer))
    if row["cuda_peak_bytes"]:
        row["peak_bytes"] = max(row["cuda_peak_bytes"].values())
    if method == "longstraw":
        row["bound_bytes"] = (row["weights_bytes"] + row["grads_bytes"] + row["optimizer_bytes"]
                              + row["resident_bytes"] + row["graph_peak_bytes"])
        if "peak_bytes" in row:
            row["peak_over_bound"] = row["peak_bytes"] / row["bound_bytes"]
        if not family_of(model).plan:
            return row
        planned = plan(bench["config"], prompt_tokens=prompt_tokens, group_size=group_size,
                       response_tokens=args.response, dtype=args.dtype, lora_rank=args.lora_rank,
                       block_size=args.block_size, score_batch=args.score_batch, logprob_chunk=args.logprob_chunk,
                       kernels=bench["kernels"])
        row["plan_peak_bytes"] = planned["peak"]
        row["plan_phase_bytes"] = planned["phases"]
        row["plan_graph_bytes"] = planned["response_graph"]
        if "peak_bytes" in row:
            row["peak_over_plan"] = row["peak_bytes"] / planned["peak"]
    return row


# -- the table ------------------------------------------------------------------------------------------------
COLUMNS = ("method", "P", "G", "status", "capture", "score", "replay", "fwd_bwd", "step", "peak", "bound",
           "pk/bnd", "plan", "pk/plan", "resident", "graph", "time_s", "tok/s")


# GiB on a GPU; tiny CPU runs read better in MiB (set in main)
UNIT = [GIB, "GiB"]


def _gib(x) -> str:
    return "-" if x is None else f"{x / UNIT[0]:.2f}"


def table_line(row: dict) -> str:
    phases = row.get("cuda_peak_bytes") or {}
    peak = row.get("peak_bytes")
    if peak is None and row.get("rss_peak_bytes") and row.get("rss_start_bytes"):
        # CPU: growth of the process's resident set during the step
        peak_text = f"{_gib(row['rss_peak_bytes'] - row['rss_start_bytes'])}r"
    else:
        peak_text = _gib(peak)
    ratio = lambda key: "-" if row.get(key) is None else f"{row[key]:.2f}"  # noqa: E731
    cells = (
        row["method"], row["prompt_tokens"], row["group_size"], row["status"],
        _gib(phases.get("capture")), _gib(phases.get("score")), _gib(phases.get("replay")),
        _gib(phases.get("fwd_bwd")), _gib(phases.get("step")), peak_text, _gib(row.get("bound_bytes")),
        ratio("peak_over_bound"), _gib(row.get("plan_peak_bytes")), ratio("peak_over_plan"),
        _gib(row.get("resident_bytes")), _gib(row.get("graph_peak_bytes")),
        "-" if row.get("step_seconds") is None else f"{row['step_seconds']:.1f}",
        "-" if row.get("tokens_per_second") is None else f"{row['tokens_per_second']:.0f}",
    )
    widths = (9, 8, 3, 7, 7, 7, 7, 7, 7, 8, 7, 6, 7, 7, 8, 7, 8, 8)
    return " ".join(f"{str(c):>{w}}" for c, w in zip(cells, widths))


def header() -> str:
    widths = (9, 8, 3, 7, 7, 7, 7, 7, 7, 8, 7, 6, 7, 7, 8, 7, 8, 8)
    return " ".join(f"{c:>{w}}" for c, w in zip(COLUMNS, widths))


# -- main -----------------------------------------------------------------------------------------------------
def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def method_list(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if not methods or bad:
        raise argparse.ArgumentTypeError(f"unknown method(s) {bad or text!r}; valid: {list(METHODS)}")
    return methods


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen36_mini", choices=MODEL_NAMES)
    p.add_argument("--num-layers", type=int, default=None, help="override num_hidden_layers (quick runs)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int_list, default=[16384, 65536], help="comma list of prompt lengths")
    p.add_argument("--groups", type=int_list, default=[2, 4, 8], help="comma list of group sizes G (>= 2)")
    p.add_argument("--response", type=int, default=1024, help="tokens per response")
    p.add_argument("--methods", type=method_list, default=list(METHODS))
    p.add_argument("--lora-rank", type=int, default=0, help="> 0: LoRA adapters only are trained")
    p.add_argument("--block-size", type=int, default=8192, help="capture block (tokens)")
    p.add_argument("--score-batch", type=int, default=TransactionConfig.score_batch,
                   help="responses scored together graph-free")
    p.add_argument("--logprob-chunk", type=int, default=TransactionConfig.logprob_chunk)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls (the reference kernels compute in fp32)")
    p.add_argument("--kernels", default="auto", choices=("auto", "reference"),
                   help="auto: what the model dispatches to (flash attention, fla GDN forward on CUDA in bf16); "
                        "reference: the torch kernels everywhere")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds since start; a configuration is skipped once they have passed or when its predicted "
                        "time would pass them")
    p.add_argument("--naive-responses", type=int, default=None,
                   help="time only this many of the baseline's G replays and extrapolate its step time to G "
                        "(rows say so: extrapolated=true); memory is measured as is (one replay's peak)")
    p.add_argument("--out", default="results.jsonl", help="JSON lines, appended")
    args = p.parse_args(argv)
    if min(args.groups) < 2:
        p.error(f"--groups: a GRPO group needs >= 2 responses, got {args.groups}")
    for name in ("response", "block_size", "score_batch", "logprob_chunk"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lora_rank < 0 or (args.num_layers is not None and args.num_layers < 1):
        p.error("--lora-rank must be >= 0 and --num-layers >= 1")
    return args


def use_reference_kernels(model) -> None:
    """The torch reference attention and chunked GDN everywhere (a fallback should a GPU kernel misbehave);
    glm52: the torch sparse MLA and DSA indexer scores instead of their Triton kernels."""
    if model.family == "glm52":
        use_kernels(mla="torch", dsa="torch")
        return
    for layer in model.model.layers:
        if layer.is_attention:
            layer.self_attn.attention_fn = reference_attention
        else:
            layer.linear_attn.gdn_fn = gdn_chunked


def build(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available here (use --device cpu)")
    torch.manual_seed(args.seed)
    overrides = {} if args.num_layers is None else {"num_hidden_layers": args.num_layers}
    model = build_model(args.model, dtype=getattr(torch, args.dtype), device=device, seed=args.seed, **overrides)
    trainable = apply_lora(model, LoraConfig(rank=args.lora_rank))
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    loss_cfg = LossConfig()
    tx_cfg = TransactionConfig(block_size=args.block_size, score_batch=args.score_batch,
                               logprob_chunk=args.logprob_chunk)
    # what the model dispatches to: flash attention + fla's GDN forward on CUDA in bf16/fp16, torch otherwise
    kernels = "gpu" if device.type == "cuda" and args.dtype in ("bfloat16", "float16") else "reference"
    if args.kernels == "reference":
        use_reference_kernels(model)
        kernels = "reference"
    return {"device": device, "model": model, "optimizer": optimizer, "config": model.config, "kernels": kernels,
            "transaction": Transaction(model, LocalStrategy(model, optimizer, MAX_GRAD_NORM), loss_cfg, tx_cfg),
            "naive": Naive(model, optimizer, loss_cfg, tx_cfg)}


def predicted_seconds(last: tuple[int, int, float] | None, method: str, prompt_tokens: int, group_size: int):
    """Rough time of a configuration from the method's previous one: time grows like P^1.5 (attention is
    quadratic, everything else linear in P); the baseline's also linearly in G (it runs the prompt G times)."""
    if last is None:
        return None
    p0, g0, t0 = last
    seconds = t0 * (prompt_tokens / p0) ** 1.5
    return seconds * group_size / g0 if method == "naive" else seconds


def sweep(bench: dict, args, started: float):
    """Yield one row per (P, G, method), prompts in the order given; skip what cannot fit in time or memory."""
    oom_at: dict[str, int] = {}
    last: dict[str, tuple[int, int, float]] = {}
    for prompt_tokens in args.prompts:
        for group_size in args.groups:
            for method in args.methods:
                row = {"method": method, "prompt_tokens": prompt_tokens, "group_size": group_size,
                       "response_tokens": args.response, "status": "skipped"}
                elapsed = time.perf_counter() - started
                # a baseline limited to its first responses runs only those
                replays = min(group_size, args.naive_responses or group_size) if method == "naive" else group_size
                predicted = predicted_seconds(last.get(method), method, prompt_tokens, replays)
                if method in oom_at and prompt_tokens >= oom_at[method]:
                    # a longer prompt needs more memory in both methods
                    row["reason"] = f"OOM at prompt {oom_at[method]}"
                elif args.time_limit is not None and elapsed > args.time_limit:
                    row["reason"] = f"time limit {args.time_limit:g}s reached after {elapsed:.0f}s"
                elif args.time_limit is not None and predicted is not None and elapsed + predicted > args.time_limit:
                    row["reason"] = f"predicted {predicted:.0f}s would pass the time limit after {elapsed:.0f}s"
                else:
                    row = measure(method, bench, prompt_tokens, group_size, args)
                    if row["status"] == "OOM":
                        oom_at[method] = min(oom_at.get(method, prompt_tokens), prompt_tokens)
                    elif row["status"] == "ok":
                        last[method] = (prompt_tokens, replays, row["wall_seconds"])
                yield row


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.tf32:
        torch.set_float32_matmul_precision("high")
    bench = build(args)
    model, device = bench["model"], bench["device"]
    meta = {
        "model": args.model, "num_layers": model.config.num_hidden_layers, "dtype": args.dtype,
        "device": str(device), "lora_rank": args.lora_rank, "block_size": args.block_size,
        "score_batch": args.score_batch, "logprob_chunk": args.logprob_chunk, "tf32": args.tf32,
        "torch": torch.__version__, "run_id": time.strftime("%Y%m%d-%H%M%S"),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "sdpa_backend": sdpa_backend(model, device, getattr(torch, args.dtype)),
        "kernels": bench["kernels"], "fla": fla_forward() is not None,
        "attention_kernel": forward_backend() if device.type == "cuda" else "reference",
    }
    print(f"# {json.dumps(meta)}", flush=True)
    if device.type != "cuda":
        UNIT[:] = [2**20, "MiB"]

    # warm-up: kernels, cuBLAS handles and the optimizer's state exist before anything is measured
    warm_prompt = min(min(args.prompts), 1024)
    for method in args.methods:
        row = measure(method, bench, warm_prompt, 2, argparse.Namespace(**{**vars(args),
                                                                           "response": min(args.response, 64)}))
        if row["status"] != "ok":
            print(f"warm-up of {method} failed: {row.get('error', row['status'])}", file=sys.stderr, flush=True)
            return 1
    static = static_bytes(model, bench["optimizer"])
    print("# static: " + ", ".join(f"{k} {_gib(v)} {UNIT[1]}" for k, v in static.items()), flush=True)
    print(f"# memory in {UNIT[1]}: per-phase peaks, peak, bound, plan, resident, graph"
          + ("" if device.type == "cuda" else "; CPU: no allocator peaks, 'peak' is RSS growth (r)"), flush=True)
    print(header(), flush=True)

    with open(args.out, "a") as out:
        for row in sweep(bench, args, started):
            row.update(meta)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(table_line(row), flush=True)
    print(f"# {time.perf_counter() - started:.0f}s; rows appended to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
