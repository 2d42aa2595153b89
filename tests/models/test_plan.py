"""The memory plan against the model's own accounting, and the shape of its curves."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from longstraw_cli.lora import LoraConfig, apply_lora
from longstraw_cli.models import build_model
from longstraw_cli.models.qwen36.config import named_config
from longstraw_cli.plan import GIB, max_prompt_tokens, plan
from longstraw_cli.plan.qwen36 import param_counts, resident_bytes
from longstraw_cli.resident.gradient import StateGrad
from longstraw_cli.telemetry.memory import GraphMemory

MINI = dict(group_size=8, response_tokens=1024, dtype="bfloat16", block_size=8192)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 129, 4000])
def test_resident_equals_model_accounting(dtype, num_tokens):
    model = build_model("qwen36_tiny", dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    assert resident_bytes(model.config, num_tokens, name) == model.resident_bytes(num_tokens)
    # plan captures prompt - 1 tokens, as capture does
    p = plan("qwen36_tiny", prompt_tokens=num_tokens + 1, group_size=2, response_tokens=8, dtype=name)
    assert p["resident_detail"] == model.resident_bytes(num_tokens)
    assert p["resident"] == model.resident_bytes(num_tokens)["total"]


def test_cp_splits_the_pages_not_the_recurrent_state():
    one = plan("qwen36_mini", prompt_tokens=2**20 + 1, **MINI)["resident_detail"]
    four = plan("qwen36_mini", cp=4, prompt_tokens=2**20 + 1, **MINI)["resident_detail"]
    assert four["kv_pages"] * 4 == one["kv_pages"]
    assert four["recurrent_state"] == one["recurrent_state"] and four["conv_state"] == one["conv_state"]


def test_parameter_count_and_lora_adapters_match_the_model():
    model = build_model("qwen36_tiny")
    assert param_counts(model.config)["total"] == sum(p.numel() for p in model.parameters())
    adapters = apply_lora(model, LoraConfig(rank=4))
    assert param_counts(model.config, lora_rank=4)["lora"] == sum(p.numel() for p in adapters)


def test_weights_grads_optimizer_of_full_fine_tuning():
    p = plan("qwen36_tiny", prompt_tokens=100, group_size=2, response_tokens=8, dtype="bfloat16")
    n = p["params"]
    assert p["trainable_params"] == n
    assert (p["weights"], p["grads"], p["optimizer"]) == (2 * n, 2 * n, 4 * n)
    fp32_moments = plan("qwen36_tiny", prompt_tokens=100, group_size=2, response_tokens=8, moment_dtype="float32")
    assert fp32_moments["optimizer"] == 8 * n


def test_lora_shrinks_grads_and_optimizer_to_the_adapters():
    full = plan("qwen36", prompt_tokens=65536, **MINI)
    lora = plan("qwen36", prompt_tokens=65536, lora_rank=16, **MINI)
    adapters = param_counts(named_config("qwen36"), lora_rank=16)["lora"]
    assert lora["trainable_params"] == adapters < full["params"] // 100
    assert lora["grads"] == 2 * adapters and lora["optimizer"] == 4 * adapters
    # the frozen base stays, the adapters come on top
    assert lora["weights"] == full["weights"] + 2 * adapters
    assert lora["peak"] < full["peak"]


def test_peak_grows_linearly_in_prompt_tokens():
    peaks = [plan("qwen36_mini", prompt_tokens=n * 2**20, **MINI)["peak"] for n in (1, 2, 3, 4)]
    steps = {b - a for a, b in zip(peaks, peaks[1:])}
    assert len(steps) == 1 and steps.pop() > 0
    # the slope is the K/V pages: 6 attention layers x (K + V) x 2 kv heads x 256 dims x 2 bytes per token
    assert peaks[1] - peaks[0] == 6 * 2 * 2 * 256 * 2 * 2**20


def test_peak_does_not_grow_with_group_size():
    def phases(group_size, **kw):
        return plan("qwen36_mini", prompt_tokens=2**20, **{**MINI, "group_size": group_size, **kw})

    small, large = phases(2), phases(64)
    # only scoring batches responses (up to score_batch): every other phase is independent of G
    for phase in ("capture", "replay", "step"):
        assert small["phases"][phase] == large["phases"][phase]
    assert small["bound"] == large["bound"]
    assert phases(8)["peak"] == phases(16)["peak"] == phases(64)["peak"]
    assert phases(2, score_batch=1)["peak"] == phases(8, score_batch=1)["peak"]


def test_max_prompt_tokens_is_monotone_and_tight():
    budgets = [30, 40, 60, 80, 139, 200]
    longest = [max_prompt_tokens("qwen36_mini", gpu_mem_gib=g, **MINI) for g in budgets]
    assert longest == sorted(longest) and longest[0] < longest[-1]
    for g, n in zip(budgets, longest):
        if n:
            assert plan("qwen36_mini", prompt_tokens=n, gpu_mem_gib=g, **MINI)["fits"]
            assert not plan("qwen36_mini", prompt_tokens=n + 1, gpu_mem_gib=g, **MINI)["fits"]
    assert max_prompt_tokens("qwen36_mini", gpu_mem_gib=1, **MINI) == 0
    # twice the ranks hold twice the prompt (up to the part that does not shard)
    assert max_prompt_tokens("qwen36_mini", cp=2, **MINI) > 1.9 * max_prompt_tokens("qwen36_mini", **MINI)


@pytest.mark.parametrize("name, dtype, overrides, tokens, tolerance", [
    ("qwen36_tiny", torch.float32, {}, 200, 0.10),
    # the mini shape's widths, one GDN and one attention layer, a small vocab
    ("qwen36_mini", torch.bfloat16, dict(num_hidden_layers=2, full_attention_interval=2, vocab_size=512), 256, 0.03),
])
def test_response_graph_estimate_matches_graph_accounting(name, dtype, overrides, tokens, tolerance):
    torch.manual_seed(0)
    model = build_model(name, dtype=dtype, **overrides)
    prompt = torch.randint(0, model.config.vocab_size, (100,))
    resident = model.capture(prompt, block_size=64)
    response = torch.randint(0, model.config.vocab_size, (tokens,))
    with GraphMemory(exclude=[*model.parameters(), *resident.tensors()]) as meter:
        model.logprobs(resident, response, grad=True)
    p = plan(model.config, prompt_tokens=100, group_size=2, response_tokens=tokens,
             dtype=str(dtype).removeprefix("torch."), kernels="reference")
    assert abs(p["response_graph"] / meter.peak_bytes - 1) < tolerance


@pytest.mark.parametrize("name, dtype, overrides, tolerance", [
    ("qwen36_tiny", torch.float32, {}, 0.10),
    # bf16's element sizes at the tiny widths (the walk at the mini widths took 207 s in bf16 on two CPU cores)
    ("qwen36_tiny", torch.bfloat16, {}, 0.10),
    # the mini widths in fp32 (7 s): measured 1% above the walk's peak (6% in bf16)
    ("qwen36_mini", torch.float32, dict(num_hidden_layers=2, full_attention_interval=2, vocab_size=512), 0.08),
])
def test_exact_walk_graph_and_state_gradient_match_the_accounting(name, dtype, overrides, tolerance):
    """Exact mode: the reverse walk's graph is one block's (GraphMemory's peak over the walk), the state gradient
    and the boundary states what the plan counts."""
    torch.manual_seed(0)
    model = build_model(name, dtype=dtype, **overrides)
    prompt, block = torch.randint(0, model.config.vocab_size, (301,)), 128
    resident = model.capture(prompt, block_size=block, boundaries=True)
    state_grad = StateGrad(resident)
    with GraphMemory(exclude=[*model.parameters(), *resident.tensors()]) as meter:
        model.prompt_backward(prompt, resident, state_grad, block)
    p = plan(model.config, prompt_tokens=301, group_size=2, response_tokens=8, block_size=block,
             dtype=str(dtype).removeprefix("torch."), gradient="exact", kernels="reference")
    assert abs(p["block_graph"] / meter.peak_bytes - 1) < tolerance
    assert p["state_grad"] == state_grad.nbytes()
    assert p["boundary_states"] == resident.nbytes()["boundary_states"]
    assert "prompt" in p["phases"] and plan(
        model.config, prompt_tokens=301, group_size=2, response_tokens=8, block_size=block,
        dtype=str(dtype).removeprefix("torch."), kernels="reference")["peak"] <= p["peak"]


def test_walk_checkpoint_trades_the_block_graph_for_layer_inputs():
    """27B shape, LoRA r16, exact at 256K: the full block graph does not fit one H200, the checkpointed walk does."""
    common = dict(prompt_tokens=262144, group_size=8, response_tokens=1024, lora_rank=16, block_size=8192,
                  gradient="exact", kernels="gpu")
    full, layered = plan("qwen36", **common), plan("qwen36", walk_checkpoint=True, **common)
    cfg = named_config("qwen36")
    assert layered["block_graph"] < full["block_graph"] / 5
    assert layered["block_graph"] > cfg.num_hidden_layers * 8192 * cfg.hidden_size * 2
    assert not full["fits"] and layered["fits"]


def test_exact_walk_counts_the_pages_backward_tiles_where_they_run():
    """On CUDA at one rank the walk's pages backward (triton_page_tiles) holds P and dS of one chunk of pages for the
    block's rows as the replay backward folds them ([kv heads, rows, chunk] each), in the prompt phase; not under
    cp > 1 (the reference backward) nor with the reference kernels."""
    from longstraw_kernels.attention import flash
    from longstraw_kernels.attention.triton_page_tiles import DEFAULT_CHUNK

    common = dict(prompt_tokens=262144, group_size=8, response_tokens=1024, block_size=4096, gradient="exact")
    cfg = named_config("qwen36_mini")
    gpu = plan("qwen36_mini", kernels="gpu", **common)
    # the shapes the walk's backward folds a block's queries into (meta tensors: shapes only)
    q = torch.empty(1, 4096, cfg.num_attention_heads, cfg.head_dim, device="meta", dtype=torch.bfloat16)
    K, M, _ = flash._fold_pages_query(q, cfg.num_key_value_heads)[0].shape
    assert gpu["page_tiles"] == 2 * K * M * DEFAULT_CHUNK * 2 == 2 << 30  # 2 GiB in bf16
    assert gpu["phases"]["prompt"] == (gpu["weights"] + gpu["grads"] + gpu["optimizer"] + gpu["resident"]
                                       + gpu["boundary_states"] + gpu["state_grad"] + gpu["block_graph"]
                                       + gpu["page_grad_transient"] + gpu["page_tiles"])
    assert plan("qwen36_mini", kernels="reference", **common)["page_tiles"] == 0
    assert plan("qwen36_mini", kernels="gpu", cp=2, **common)["page_tiles"] == 0


def test_bound_and_phases_add_up():
    p = plan("qwen36_mini", prompt_tokens=262144, **MINI)
    assert p["bound"] == p["weights"] + p["grads"] + p["optimizer"] + p["resident"] + p["response_graph"]
    assert p["peak"] == max(p["phases"].values()) >= p["bound"]
    assert p["phases"]["replay"] == p["bound"] + p["replay_transient"]
    assert p["budget"] == 139 * GIB


def test_custom_config_and_bad_input():
    cfg = dataclasses.replace(named_config("qwen36_mini"), num_hidden_layers=4)
    assert plan(cfg, prompt_tokens=1000, **MINI)["weights"] < plan("qwen36_mini", prompt_tokens=1000, **MINI)["weights"]
    with pytest.raises(ValueError, match="prompt_tokens"):
        plan("qwen36_mini", prompt_tokens=0, **MINI)
    with pytest.raises(ValueError, match="dtype"):
        plan("qwen36_mini", prompt_tokens=10, **{**MINI, "dtype": "bf16"})
    with pytest.raises(ValueError, match="unknown model .qwen99."):
        plan("qwen99", prompt_tokens=10, **MINI)


def test_python_m_plan_is_the_longstraw_plan_command(capsys):
    """`python -m longstraw_cli.plan` takes `longstraw plan`'s overrides and defaults; a comma list of prompt
    lengths gives one row each, with the numbers of plan() on the training config's defaults."""
    from longstraw_cli.__main__ import main as longstraw

    args = ["model=qwen36_mini", "prompt_tokens=64K,1M", "group_size=4"]
    module = subprocess.run([sys.executable, "-m", "longstraw_cli.plan", *args], capture_output=True, text=True,
                            timeout=300)
    assert module.returncode == 0, module.stderr
    assert longstraw(["plan", *args]) == 0
    out = capsys.readouterr().out
    assert out == module.stdout
    # the training config's defaults: response_tokens 16, capture.block_size 4096, logprob_chunk 512
    for n in (65536, 1048576):
        want = plan("qwen36_mini", prompt_tokens=n, group_size=4, response_tokens=16, block_size=4096,
                    logprob_chunk=512)
        assert f"{n:>9} " in out and f"{want['peak'] / GIB:.2f}" in out
    assert "longest prompt" in out and "phases: capture" in out


def test_plan_into_a_closed_pipe_ends_without_a_traceback():
    """`longstraw plan | head -4`: the reader is gone before the table is written; the rest goes nowhere, quietly."""
    proc = subprocess.Popen([sys.executable, "-m", "longstraw_cli", "plan"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0 and err == "", err


def test_longstraw_plan_command_reads_the_training_config(capsys):
    """`longstraw plan` with train's overrides: the same numbers as plan() on the composed config."""
    from longstraw_cli.__main__ import main as longstraw

    assert longstraw(["plan", "model=qwen36", "cp=8", "prompt_tokens=2M", "group_size=8", "lora.rank=16",
                      "response_tokens=1K", "gpu_mem_gib=80"]) == 0
    out = capsys.readouterr().out
    want = plan("qwen36", cp=8, prompt_tokens=2**21, group_size=8, response_tokens=1024, lora_rank=16,
                dtype="bfloat16", gpu_mem_gib=80, block_size=4096, score_batch=8, logprob_chunk=512)
    assert f"{want['peak'] / GIB:.2f}" in out and "cp=8" in out and "lora_rank=16" in out
    longest = max_prompt_tokens("qwen36", cp=8, group_size=8, response_tokens=1024, lora_rank=16, dtype="bfloat16",
                                gpu_mem_gib=80, block_size=4096, score_batch=8, logprob_chunk=512)
    assert f"longest prompt that fits in 80 GiB: {longest} tokens" in out


def test_longstraw_plan_plans_the_shape_override_config_gives(capsys):
    from longstraw_cli.__main__ import main as longstraw

    assert longstraw(["plan", "model=qwen36", "model.override_config={num_hidden_layers:16}", "prompt_tokens=1M",
                      "lora.rank=16", "response_tokens=1K"]) == 0
    out = capsys.readouterr().out
    want = plan(named_config("qwen36", num_hidden_layers=16), prompt_tokens=2**20, group_size=8, response_tokens=1024,
                lora_rank=16, dtype="bfloat16", block_size=4096, score_batch=8, logprob_chunk=512)
    full = plan("qwen36", prompt_tokens=2**20, group_size=8, response_tokens=1024, lora_rank=16, dtype="bfloat16",
                block_size=4096, score_batch=8, logprob_chunk=512)
    assert "qwen36 (16 layers)" in out and f"{want['peak'] / GIB:.2f}" in out and want["peak"] < full["peak"]


@pytest.mark.parametrize("args, message", [
    (["cp=x"], "cp='x' must be an integer"),
    (["algo.kl_coef=abc"], "algo.kl_coef='abc' must be a number"),
    (["cp=0"], "cp must be an int >= 1, got 0"),
    (["gpu_mem_gib=lots"], "gpu_mem_gib='lots' is not a number"),
    (["plan_kernels=fast"], "plan_kernels='fast'; valid: ['auto', 'gpu', 'reference']"),
    (["prompt_tokens=3Q"], "prompt_tokens='3Q' is not a token count; e.g. 65536, 64K, 2M"),
    (["prompt_tokens=1M,x"], "prompt_tokens='x' is not a token count"),
    (["model=glm52_tiny", "ep=3"], "ep=3 must divide cp=1"),
    (["ep=2", "cp=2"], "model family 'qwen36' has no routed experts"),
    (["modle=qwen36"], "unknown config key 'modle'"),
    # plan's own keys are among the valid ones, the closest named
    (["gpu_mem=80"], "unknown config key 'gpu_mem' (did you mean 'gpu_mem_gib'?); valid keys at the top level: "
                     "['algo', 'capture', 'checkpoint', 'compile_cache_dir', 'cp', 'device', 'dist_timeout_s', 'ep', "
                     "'export_hf', 'gpu_mem_gib', 'group_size', 'host_mem_gib', 'kernels', "),
    (["optim.lr=1e-3,3e-3"], "optim.lr=1e-3,3e-3 is a sweep (a comma list)"),
    # a path takes ~ as train's does (expanded, then found missing)
    (["model.path=~/no-such-model"], "model.path='/"),
])
def test_longstraw_plan_command_rejects_bad_values_in_one_line(capsys, args, message):
    from longstraw_cli.__main__ import main as longstraw

    try:
        code = longstraw(["plan", *args])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_reuse_keeps_one_boundary_and_the_peak_grows_by_under_0_2_percent():
    """capture.reuse_steps > 1: the tail states are what the capture keeps; at 1M (qwen36_mini, G=8) they and the
    drift probe's copies leave the peak within 0.2% of a run without reuse."""
    model = build_model("qwen36_tiny")
    resident = model.capture(torch.randint(0, 259, (301,)), block_size=64, tail=1024)
    tiny = plan(model.config, prompt_tokens=301, group_size=2, response_tokens=8, block_size=64, dtype="float32",
                kernels="reference", reuse=True)
    assert tiny["tail_states"] == resident.nbytes()["tail_states"] > 0
    assert tiny["resident"] + tiny["tail_states"] == resident.nbytes()["total"]
    today, reused = (plan("qwen36_mini", prompt_tokens=1048576, reuse=reuse, **MINI) for reuse in (False, True))
    print(f"1M peak {today['peak'] / GIB:.2f} GiB, with reuse {reused['peak'] / GIB:.2f} GiB "
          f"(drift phase {reused['phases']['drift'] / GIB:.2f} GiB)")
    assert today["peak"] < reused["peak"] <= 1.002 * today["peak"]


def test_offload_moves_all_but_two_layers_pages_to_the_host():
    """capture.offload=cpu: the K/V pages in host memory; on the GPU the GDN states and two attention layers' pages
    (the staged one and the next in flight), so every phase drops by the pages less those two layers."""
    on, off = (plan("qwen36_mini", prompt_tokens=1048576, offload=o, **MINI) for o in ("none", "cpu"))
    pages, layers = on["resident_detail"]["kv_pages"], sum(t == "full_attention"
                                                          for t in named_config("qwen36_mini").layer_types)
    assert off["host"] == pages and on["host"] == 0
    assert off["resident_device"] == on["resident"] - pages + 2 * (pages // layers)
    for phase, nbytes in on["phases"].items():
        # the optimizer step holds no pages either way (dropped after the replays)
        moved = 0 if phase == "step" else pages - 2 * (pages // layers)
        assert off["phases"][phase] == nbytes - moved, phase
    assert max_prompt_tokens("qwen36_mini", offload="cpu", **MINI) > max_prompt_tokens("qwen36_mini", **MINI)


def test_offload_under_context_parallel_keeps_each_ranks_shard_on_the_host(capsys):
    """cp > 1 with capture.offload=cpu: each rank's host holds its shard of the K/V pages (`host`, per rank: the
    one-rank pages / cp, rounded up to whole tokens); its GPU the GDN states and two attention layers' pages of the
    shard, so every phase drops by the shard's pages less those two layers; offload then admits a longer prompt
    per rank's GPU, and the command reports both placements and the host bytes per rank."""
    from longstraw_cli.__main__ import main as longstraw

    common = dict(cp=4, prompt_tokens=4 * 2**20 + 1, **MINI)
    on, off = (plan("qwen36_mini", offload=o, **common) for o in ("none", "cpu"))
    one = plan("qwen36_mini", prompt_tokens=4 * 2**20 + 1, offload="cpu", **MINI)
    layers = sum(t == "full_attention" for t in named_config("qwen36_mini").layer_types)
    pages = on["resident_detail"]["kv_pages"]
    assert off["host"] == pages == one["host"] // 4 and on["host"] == 0
    assert off["resident_device"] == on["resident"] - pages + 2 * (pages // layers)
    for phase, nbytes in on["phases"].items():
        # the optimizer step holds no pages either way (dropped after the replays)
        moved = 0 if phase == "step" else pages - 2 * (pages // layers)
        assert off["phases"][phase] == nbytes - moved, phase
    assert off["fits"] and plan("qwen36_mini", offload="cpu", host_mem_gib=off["host"] / GIB * 0.99,
                                **common)["fits"] is False
    limits = {o: max_prompt_tokens("qwen36_mini", cp=4, offload=o, **MINI) for o in ("none", "cpu")}
    assert limits["cpu"] > limits["none"]
    assert longstraw(["plan", "model=qwen36", "lora.rank=16", "cp=4", "prompt_tokens=4M", "capture.offload=cpu"]) == 0
    out = capsys.readouterr().out
    big = plan("qwen36", cp=4, prompt_tokens=4 * 2**20, group_size=8, response_tokens=16, lora_rank=16,
               offload="cpu", block_size=4096)
    assert f"offload=cpu: this rank's shard ({2**20} tokens) pages in host memory {big['host'] / GIB:.2f} GiB per " \
           f"rank" in out
    assert "longest prompt per placement: offload=none: " in out and ", offload=cpu: " in out


def test_offloaded_rollout_copies_whole_layers_into_free_memory():
    """The rollout's copies of host pages (rollout.native.offload_copy_gib): all where the GPU has room, whole
    layers under a cap or in a smaller GPU, none at 0; the rollout's figure is what it holds besides."""
    common = dict(prompt_tokens=1048576, offload="cpu", **MINI)
    auto = plan("qwen36_mini", **common)
    layer = auto["host"] // sum(t == "full_attention" for t in named_config("qwen36_mini").layer_types)
    assert auto["rollout_copies"] == auto["host"]
    # all copied: the rollout holds weights, optimizer, the whole resident state and the decode's buffers and step
    # (no grads, no graph)
    decoding = auto["decode_buffers"] + auto["decode_growth"] + auto["decode_step"] + auto["decode_projections"]
    assert auto["rollout"] == auto["weights"] + auto["optimizer"] + auto["resident"] + decoding
    # the copies take only free memory: they never move the peak (nor what fits)
    capped = plan("qwen36_mini", offload_copy_gib=0, **common)
    assert capped["rollout"] == auto["rollout"] - auto["host"] and capped["peak"] == auto["peak"]
    assert capped["rollout_copies"] == 0
    assert plan("qwen36_mini", offload_copy_gib=2.5 * layer / GIB, **common)["rollout_copies"] == 2 * layer
    # a GPU that small makes no concatenated input linears (past a 16th of it): they leave the rollout's base
    base = auto["rollout"] - auto["host"] - auto["decode_projections"]
    small = plan("qwen36_mini", gpu_mem_gib=(base + 3.5 * layer * 1.1) / GIB, **common)
    assert small["decode_projections"] == 0 and small["rollout_copies"] == 3 * layer
    assert plan("qwen36_mini", prompt_tokens=1048576, **MINI)["rollout_copies"] == 0


def test_longstraw_plan_command_prints_the_offloaded_rollout(capsys):
    from longstraw_cli.__main__ import main as longstraw

    assert longstraw(["plan", "model=qwen36", "lora.rank=16", "prompt_tokens=1M", "capture.offload=cpu",
                      "rollout.native.offload_copy_gib=30"]) == 0
    out = capsys.readouterr().out
    assert "pages in host memory 64.00 GiB" in out
    assert "28.00 GiB of pages copied to the GPU for it (rollout.native.offload_copy_gib=30)" in out
    assert "36.00 GiB read from host memory at every decode token" in out


def test_the_longest_prompt_stops_at_the_models_positions(capsys):
    """Memory would allow far more than qwen36_tiny's 65,536 positions: the plan's longest prompt is what
    `longstraw train` accepts (positions less the response), and a prompt past it is named."""
    from longstraw_cli.__main__ import main as longstraw

    assert longstraw(["plan", "model=qwen36_tiny", "prompt_tokens=70000", "response_tokens=16"]) == 0
    out = capsys.readouterr().out
    assert ("70000 is past the model's positions: with response_tokens=16 its 65536 positions leave room for "
            "65520") in out
    assert "longest prompt that fits in 139 GiB: 65520 tokens (0.06M) (the model's 65536 positions" in out
    assert "offload=none: 65520 tokens" in out


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_plan_counts_the_decodes_concatenated_input_linears(lora_rank):
    """`decode_projections` is what the decoder copies: every layer's input linears without LoRA, the groups
    holding an adapted linear not at all under LoRA's default targets (GDN's b and a are not targets, but share a
    GEMM with qkv and z)."""
    from longstraw_cli.models.projections import InProjections

    model = build_model("qwen36_tiny", dtype=torch.bfloat16, device="cpu", seed=0)
    if lora_rank:
        apply_lora(model, LoraConfig(rank=lora_rank))
    resident = model.capture(torch.arange(40) % 200, block_size=16)
    decoder = model.decoder(resident, 2, 4)
    copied = sum(p.weight_NC.numel() * p.weight_NC.itemsize for pair in decoder.projections for p in pair
                 if isinstance(p, InProjections))
    planned = plan("qwen36_tiny", prompt_tokens=40, group_size=2, response_tokens=4, lora_rank=lora_rank)
    assert planned["decode_projections"] == copied and (copied > 0) == (lora_rank == 0)
    # offloaded pages or not; none past a 16th of the GPU (the decoder's own test: tests/models/test_decode.py)
    assert plan("qwen36_tiny", prompt_tokens=40, group_size=2, response_tokens=4, lora_rank=lora_rank,
                offload="cpu")["decode_projections"] == copied
    if copied:
        for sixteenths, planned_copies in ((16.0, copied), (15.9, 0)):
            assert plan("qwen36_tiny", prompt_tokens=40, group_size=2, response_tokens=4, lora_rank=lora_rank,
                        gpu_mem_gib=sixteenths * copied / GIB)["decode_projections"] == planned_copies
