"""`longstraw plan capture.replay_block=N`: the planned replay is one block's graph plus the response's keys and
the walk's response state, so it grows with the response by well under 1 MiB a token for the 27B shape (the issue's
target; the whole replay grows ~25 MiB a token); the issue's fits come out; the report prints the longest response
that fits beside the prompt."""

import pytest

from conftest import composed
from longstraw_cli.plan import max_response_tokens, plan, report

MIB = 2**20
COMMON = dict(group_size=8, lora_rank=16, gpu_mem_gib=139.0)


def replay_bytes(model, R, block):
    p = plan(model, prompt_tokens=262144, response_tokens=R, replay_block=block, **COMMON)
    return p["phases"]["replay"], p


@pytest.mark.parametrize("model", ["qwen36", "glm52_mini"])
def test_replay_grows_with_the_response_by_its_keys_only(model):
    short, _ = replay_bytes(model, 4096, 256)
    long, p = replay_bytes(model, 32768, 256)
    whole_short, _ = replay_bytes(model, 1024, 0)
    whole_long, _ = replay_bytes(model, 4096, 0)
    growth = (long - short) / (32768 - 4096)
    whole_growth = (whole_long - whole_short) / (4096 - 1024)
    print(f"{model}: replay growth per response token {growth / MIB:.3f} MiB (whole replay {whole_growth / MIB:.2f})")
    assert growth <= 1 * MIB and growth < whole_growth / 10
    assert p["response_state"] > 0 and "replay_block=256" in " ".join(p["notes"])


@pytest.mark.parametrize("model", ["qwen36", "glm52_mini"])
def test_responses_within_a_block_plan_the_whole_replay(model):
    """R <= replay_block replays whole (transaction.py): the replay phase is the whole replay's, no response state;
    one token more goes in blocks."""
    within, p = replay_bytes(model, 1024, 1024)
    whole, _ = replay_bytes(model, 1024, 0)
    assert within == whole and p["response_state"] == 0
    assert replay_bytes(model, 1025, 1024)[1]["response_state"] > 0


def test_the_issues_targets_fit_on_one_h200():
    """The 27B shape, LoRA r16, G=8: R = 32K beside a 256K prompt, R = 8K beside a 768K prompt (blocks of 256);
    neither fits replayed whole."""
    assert plan("qwen36", prompt_tokens=262144, response_tokens=32768, replay_block=256, **COMMON)["fits"]
    assert plan("qwen36", prompt_tokens=786432, response_tokens=8192, replay_block=256, **COMMON)["fits"]
    assert not plan("qwen36", prompt_tokens=262144, response_tokens=8192, **COMMON)["fits"]
    assert max_response_tokens("qwen36", prompt_tokens=262144, replay_block=256, **COMMON) >= 32768


def test_report_prints_the_longest_response(capsys):
    from longstraw_cli.models import family_of

    cfg = family_of("qwen36_mini").named_config("qwen36_mini")
    assert report(cfg, "qwen36_mini", [262144], cp=1, ep=1, response_tokens=8192, dtype="bfloat16",
                  block_size=4096, score_batch=8, logprob_chunk=1024, replay_block=512, **COMMON) == 0
    out = capsys.readouterr().out
    assert "longest response that fits beside a 262144-token prompt:" in out and "(replay_block=512)" in out


@pytest.mark.parametrize("name, dtype, overrides, tolerance", [
    # the mini widths in fp32 (bf16 matmuls on two CPU cores took 4 minutes here; the accounting is per dtype)
    pytest.param("qwen36_mini", "float32", dict(num_hidden_layers=2, full_attention_interval=2, vocab_size=512),
                 0.10, marks=pytest.mark.slow),
    ("glm52_tiny", "float32", {}, 0.10),
])
def test_block_graph_and_response_state_match_the_accounting(name, dtype, overrides, tolerance):
    """The plan's block graph (reference kernels: one block of 64, the torch chunked GDN's chunk) and response state
    against GraphMemory's peak over a blockwise replay and the walk's held bytes."""
    import torch

    from longstraw_cli.models import build_model
    from longstraw_cli.telemetry.memory import GraphMemory

    torch.manual_seed(0)
    model = build_model(name, dtype=getattr(torch, dtype), **overrides)
    prompt = torch.randint(0, model.config.vocab_size, (100,))
    resident = model.capture(prompt, block_size=64)
    R, block = 256, 64
    response = torch.randint(0, model.config.vocab_size, (R,))
    meter = GraphMemory(exclude=[*model.parameters(), *resident.tensors()])
    with meter:
        model.replay_blocks(resident, response, lambda logp: torch.ones_like(logp), block,
                            on_state=lambda state: meter.hold(state.nbytes()))
    p = plan(model.config, prompt_tokens=100, group_size=2, response_tokens=R, dtype=dtype, kernels="reference",
             replay_block=block)
    print(f"{name}: block graph planned {p['response_graph']} B, measured {meter.peak_bytes} B; response state "
          f"planned {p['response_state']} B, measured {meter.held_peak_bytes} B")
    assert abs(p["response_graph"] / meter.peak_bytes - 1) < tolerance
    assert abs(p["response_state"] / meter.held_peak_bytes - 1) < tolerance


@pytest.mark.parametrize("overrides, expected", [
    # the 27B shape's whole replay at R = 4K plans 171.5 GiB: the line names the replay and capture.replay_block
    (["response_tokens=4096"], "(replay), over this GPU's 139.0 GiB; whole responses of response_tokens=4096: "
                               "capture.replay_block=N replays and scores them in blocks of N tokens"),
    # in blocks it fits: no line
    (["response_tokens=4096", "capture.replay_block=256"], None),
    # over in blocks too (a prompt past memory): the phase, without the replay_block advice
    (["response_tokens=4096", "capture.replay_block=256", "prompt_tokens=4194304"], "over this GPU's 139.0 GiB ("),
])
def test_train_warns_before_step_0_where_the_plan_exceeds_the_gpu(overrides, expected):
    """`longstraw train` on a GPU runs `preflight` with the device's memory before step 0 (cli._warn_if_planned_over;
    not run here: it needs CUDA): a line where the plan of the run does not fit, None where it does."""
    from omegaconf import OmegaConf

    from longstraw_cli.cli import preflight

    cfg = OmegaConf.create(composed(["model=qwen36", "lora.rank=16", "group_size=2", "prompt_tokens=262144",
                                     "run_dir=x", *overrides]))
    line = preflight(cfg, 139 * 2**30)
    if expected is None:
        assert line is None
    else:
        assert line.startswith("the plan puts this run's peak at ") and expected in line, line
        assert line.endswith("(`longstraw plan` with the same overrides shows each phase)")
        assert ("capture.replay_block" in line) == ("replay_block=256" not in " ".join(overrides))


def test_the_warning_is_one_line_on_rank_0_and_never_stops_a_run(monkeypatch, capsys):
    """cli._warn_if_planned_over with a stand-in CUDA device of 139 GiB: the line on stderr; a config the planner
    refuses (qwen36 with ep=2) prints nothing and raises nothing; a CPU device is not planned."""
    from types import SimpleNamespace

    import torch
    from omegaconf import OmegaConf

    from longstraw_cli import cli

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=139 * 2**30))
    monkeypatch.delenv("RANK", raising=False)
    gpu = SimpleNamespace(device=torch.device("cuda", 0), task=SimpleNamespace(uses_prompt_tokens=True))
    base = ["model=qwen36", "lora.rank=16", "group_size=2", "prompt_tokens=262144", "run_dir=x", "response_tokens=4096"]
    cli._warn_if_planned_over(OmegaConf.create(composed(base)), gpu)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("longstraw: the plan puts this run's peak at 171.5 GiB"), err
    cli._warn_if_planned_over(OmegaConf.create(composed([*base, "ep=2"])), gpu)  # qwen36 has no experts: refused
    cpu = SimpleNamespace(device=torch.device("cpu"), task=gpu.task)
    cli._warn_if_planned_over(OmegaConf.create(composed(base)), cpu)
    assert capsys.readouterr().err == ""
