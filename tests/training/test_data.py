"""What a verl or TRL user brings: a model directory's tokenizer and chat template, verl's and TRL's data files,
their reward functions, a learning-rate schedule, several prompts per step, and the live progress line."""

import io
import json
import logging
import math
import sys

import pytest
import torch

from conftest import CHATML, chat_model_dir, checked_task, randomize_, rel_err
from longstraw_cli.config import ModelConfig
from longstraw_cli.rl.reward_adapters import GroupReward, RewardError
from longstraw_cli.rl.tasks import Example, TaskConfig, make_task
from longstraw_cli.schedule import lr_factor
from longstraw_cli.tokenizer import (
    ByteTokenizer,
    load_tokenizer,
    read_chat_template,
    render_prompt,
    resolve_tokenizer,
    stop_token_ids,
)

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return chat_model_dir(tmp_path_factory.mktemp("chat_model"))


def verl_rows(n):
    """Rows as verl's data preprocessing writes them (examples/data_preprocess/gsm8k.py)."""
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


def write_parquet(path, rows):
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- tokenizer and chat template -----------------------------------------------------------------------------------
def test_tokenizer_follows_the_model_directory(model_dir, tmp_path):
    assert resolve_tokenizer(None, str(model_dir)) == str(model_dir)
    assert ModelConfig(path=str(model_dir)).tokenizer == str(model_dir)
    assert ModelConfig(path=str(model_dir), tokenizer="byte").tokenizer == "byte"
    bare = tmp_path / "weights_only"
    bare.mkdir()
    (bare / "config.json").write_text((model_dir / "config.json").read_text())
    assert resolve_tokenizer(None, str(bare)) == "byte" and resolve_tokenizer(None, None) == "byte"


def test_chat_prompts_go_through_the_template_and_stop_at_end_of_turn(model_dir):
    tok = load_tokenizer(str(model_dir))
    assert tok.vocab_size == 259
    # EOS, then the template's end-of-turn (found by rendering a probe conversation)
    assert tok.stop_token_ids == (256, 258)
    assert render_prompt(tok, CHAT, None) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                                              "What is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert render_prompt(tok, "2+2=", None) == "2+2="
    assert render_prompt(tok, "2+2=", True) == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="chat_template=false"):
        render_prompt(tok, CHAT, False)
    # the template's special tokens are single ids, not their characters
    ids = tok.encode(render_prompt(tok, CHAT, None))
    assert ids[0] == 257 and ids.count(258) == 2
    # generation_config.json's eos ids join the stop set
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [258, 256, 7]}))
    try:
        assert stop_token_ids(tok, str(model_dir)) == (256, 258, 7)
    finally:
        (model_dir / "generation_config.json").unlink()


def test_custom_chat_template_replaces_the_tokenizers_and_serves_the_byte_tokenizer(model_dir, tmp_path):
    custom = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    template_file = tmp_path / "t.jinja"
    template_file.write_text(custom)
    assert read_chat_template(str(template_file)) == custom == read_chat_template(custom)
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template("no_such.jinja")
    hf = load_tokenizer(str(model_dir), chat_template=custom)
    assert render_prompt(hf, CHAT[1:], None) == "[user] What is 2+2?\n[assistant] "
    with pytest.raises(ValueError, match="byte tokenizer has no chat template"):
        render_prompt(ByteTokenizer(), CHAT, None)
    assert render_prompt(ByteTokenizer(CHATML), CHAT[1:], None).endswith("<|im_start|>assistant\n")


# -- data files -----------------------------------------------------------------------------------------------------
def test_verl_parquet_rows_work_as_they_are(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", verl_rows(3))
    task = make_task(TaskConfig("dataset", path=str(path)), ByteTokenizer())
    assert len(task) == 3 and not task.uses_prompt_tokens
    ex = task.example(4)
    assert ex.prompt == [{"role": "user", "content": "What is 1+1?"}] and ex.answer == "2"
    assert ex.meta["data_source"] == "openai/gsm8k" and ex.meta["extra_info"] == {"split": "train", "index": 1}
    assert ex.where == f"{path} row 1"


def test_trl_rows_and_dotted_keys(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "Say a"}], "solution": "a", "level": 1},
            {"prompt": [{"role": "user", "content": "Say b"}], "solution": "b", "level": 2}]
    for name in ("jsonl", "dataset"):
        task = make_task(TaskConfig(name, path=str(write_jsonl(tmp_path / "trl.jsonl", rows))), ByteTokenizer())
        ex = task.example(1)
        assert ex.answer == "b" and ex.meta == {"solution": "b", "level": 2}
    nested = [{"q": {"text": "2+2="}, "meta": {"gold": 4}}]
    cfg = TaskConfig("jsonl", path=str(write_jsonl(tmp_path / "nested.jsonl", nested)), prompt_key="q.text",
                     answer_key="meta.gold")
    ex = make_task(cfg, ByteTokenizer()).example(0)
    assert (ex.prompt, ex.answer, ex.ground_truth) == ("2+2=", "4", 4)


def test_data_errors_name_the_file_and_row(tmp_path):
    tok = ByteTokenizer()
    path = write_parquet(tmp_path / "train.parquet", verl_rows(2))
    with pytest.raises(ValueError, match="is parquet: use task=dataset"):
        make_task(TaskConfig("jsonl", path=str(path)), tok)
    with pytest.raises(ValueError, match=f"{path} row 0: missing field 'question'"):
        checked_task(TaskConfig("dataset", path=str(path), prompt_key="question"), tok)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read .*bad.json.* as json"):
        make_task(TaskConfig("dataset", path=str(bad)), tok)
    lines = write_jsonl(tmp_path / "content.jsonl", [{"prompt": [{"role": "user", "content": ["image"]}]}])
    with pytest.raises(ValueError, match=f"{lines}:1: 'prompt' must be a string or a list of chat messages"):
        checked_task(TaskConfig("jsonl", path=str(lines)), tok)


def test_jsonl_keeps_offsets_and_reads_a_row_when_served(tmp_path):
    """The jsonl task holds each row's offset, not the row: a file of long responses is not held on every rank.
    Rows after blank lines and with multi-byte text are found; each is parsed again when served."""
    rows = [{"prompt": f"q{i} \u00e9\u6f22", "answer": str(i), "responses": ["x" * 1000] * 4} for i in range(5)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows[:2]) + "\n\n\n"
                    + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows[2:]), encoding="utf-8")
    task = make_task(TaskConfig("jsonl", path=str(path)), ByteTokenizer())
    assert type(task.rows).__name__ == "JsonlRows" and not hasattr(task.rows, "rows")
    assert len(task) == 5 and list(task.rows.lines) == [1, 2, 5, 6, 7]
    for i in range(5):
        ex = task.example(i)
        assert (ex.prompt, ex.answer, ex.where) == (rows[i]["prompt"], str(i), f"{path}:{task.rows.lines[i]}")
    assert task.rows[3] is not task.rows[3] and task.rows[3] == rows[3]


def test_seeded_shuffle_gives_each_epoch_its_own_order(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": str(i), "answer": str(i)} for i in range(8)])

    def order(seed, indices):
        task = make_task(TaskConfig("jsonl", path=str(path), shuffle=True, seed=seed), ByteTokenizer())
        return [task.example(i).prompt for i in indices]

    epochs = order(0, range(24))
    assert all(sorted(epochs[e * 8:(e + 1) * 8]) == sorted(map(str, range(8))) for e in range(3))
    assert epochs[:8] != epochs[8:16] and epochs[:8] != [str(i) for i in range(8)]
    # example i does not depend on what was drawn before it (a resumed run asks for it directly)
    assert order(0, [17, 3]) == [epochs[17], epochs[3]] and order(1, range(8)) != epochs[:8]


# -- rewards --------------------------------------------------------------------------------------------------------
VERL_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "openai/gsm8k" and extra_info["split"] == "train"
    return {"score": float(solution_str.strip() == ground_truth), "acc": 1}
"""
TRL_REWARD = """
def match(prompts, completions, solution, **kwargs):
    assert len(prompts) == len(completions) == len(kwargs["completion_ids"]) == len(solution)
    return [float(c[0]["content"] == s) for c, s in zip(completions, solution)]

def nan_reward(response, example):
    return float("nan")

def needs_column(completions, difficulty):
    return [0.0] * len(completions)
"""


@pytest.fixture
def reward_files(tmp_path, monkeypatch):
    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    (tmp_path / "trl_rewards_mod.py").write_text(TRL_REWARD)
    # `module:function` from the working directory, which is not on sys.path (the `longstraw` script's case)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    sys.modules.pop("trl_rewards_mod", None)


def test_verl_and_trl_rewards_are_called_their_way(reward_files, tmp_path):
    verl_task = make_task(TaskConfig("dataset", path=str(write_parquet(tmp_path / "v.parquet", verl_rows(2)))),
                          ByteTokenizer())
    verl = GroupReward("verl_reward.py:compute_score", "auto", verl_task.example(0))
    assert verl.style == "verl"
    assert verl(verl_task.example(1), ["2", " 2 ", "3"], [[50], [32, 50, 32], [51]]) == [1.0, 1.0, 0.0]
    # the dict's other keys are the step's reward/<key> metrics
    assert verl.score(verl_task.example(1), ["2"], [[50]]).extra == [{"acc": 1.0}]

    rows = [{"prompt": [{"role": "user", "content": "Say a"}], "solution": "a"}]
    trl_task = make_task(TaskConfig("jsonl", path=str(write_jsonl(tmp_path / "t.jsonl", rows))), ByteTokenizer())
    trl = GroupReward("trl_rewards_mod:match", "auto", trl_task.example(0))
    assert trl.style == "trl"
    assert trl(trl_task.example(0), ["a", "b"], [[97], [98]]) == [1.0, 0.0]


def test_a_verl_rewards_other_numbers_are_kept_and_the_rest_named_once(tmp_path, caplog):
    (tmp_path / "extra.py").write_text(
        "import torch\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 1.0, 'acc': solution_str == ground_truth, 'steps': torch.tensor(3),\n"
        "            'pred': solution_str, 'ratio': float('nan')}\n")
    example = Example("p", "a")
    spec = f"{tmp_path / 'extra.py'}:compute_score"
    verl = GroupReward(spec, "auto", example)
    caplog.set_level(logging.WARNING, logger="longstraw")
    scores = verl.score(example, ["a", "b"], [[97], [98]])
    assert scores.values == [1.0, 1.0]
    assert scores.extra == [{"acc": 1.0, "steps": 3.0}, {"acc": 0.0, "steps": 3.0}]
    assert [r.getMessage() for r in caplog.records] == [
        f"reward {spec!r} returns 'pred' = 'a', not a finite number: not logged as reward/pred",
        f"reward {spec!r} returns 'ratio' = nan, not a finite number: not logged as reward/ratio"]


def test_reward_signature_is_checked_at_start_with_one_line(reward_files, tmp_path):
    rows = [{"prompt": "p", "solution": "a"}]
    probe = make_task(TaskConfig("jsonl", path=str(write_jsonl(tmp_path / "t.jsonl", rows))),
                      ByteTokenizer()).example(0)
    with pytest.raises(ValueError, match=r"cannot be called as a trl reward.*'difficulty'.*columns: \['solution'\]"):
        GroupReward("trl_rewards_mod:needs_column", "auto", probe)
    with pytest.raises(ValueError, match="cannot be called as a verl reward"):
        GroupReward("trl_rewards_mod:nan_reward", "verl", probe)
    with pytest.raises(ValueError, match="no such file"):
        GroupReward("missing.py:fn", "auto", probe)


def test_a_failing_reward_names_itself_and_the_row(reward_files, tmp_path):
    rows = [{"prompt": "p", "answer": "a"}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    ex = make_task(TaskConfig("jsonl", path=str(path)), ByteTokenizer()).example(0)
    with pytest.raises(RewardError, match=f"reward 'trl_rewards_mod:nan_reward' returned nan on {path}:1"):
        GroupReward("trl_rewards_mod:nan_reward", "native", ex)(ex, ["a", "b"], [[97], [98]])
    with pytest.raises(RewardError, match=f"'verl_reward.py:compute_score' failed on {path}:1: AssertionError"):
        GroupReward("verl_reward.py:compute_score", "verl", ex)(ex, ["a", "b"], [[97], [98]])


# -- schedule, progress, prompts per step ------------------------------------------------------------------------------
def test_learning_rate_schedules():
    def factors(schedule, total_steps=6, **kw):
        return [lr_factor(s, total_steps=total_steps, schedule=schedule, **kw) for s in range(total_steps)]

    assert factors("constant", warmup_steps=0) == [1.0] * 6
    assert factors("constant", warmup_steps=2) == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    # after warmup the schedule runs from the full rate at its first step; it reaches min_lr_ratio after the last
    # (step 6 of 6), so the last applied step still moves the weights
    assert factors("linear", warmup_steps=2) == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])
    cosine = factors("cosine", warmup_steps=1, min_lr_ratio=0.1)
    assert cosine[:2] == [1.0, 1.0] and cosine[-1] > 0.1
    assert cosine[3] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 2 / 5)))
    for schedule in ("linear", "cosine"):
        assert lr_factor(6, total_steps=6, warmup_steps=1, schedule=schedule, min_lr_ratio=0.1) == pytest.approx(0.1)
        # no applied step is at the floor, however few the steps
        for total_steps in (1, 2, 3):
            assert min(factors(schedule, total_steps, warmup_steps=0)) > 0
        assert factors(schedule, 1, warmup_steps=0) == [1.0]


def test_progress_line_shows_step_phase_and_eta():
    from rich.console import Console

    from longstraw_cli.telemetry.progress import StepProgress

    out = io.StringIO()
    progress = StepProgress(10, 2, enabled=True, rank=0, console=Console(file=out, force_terminal=True, width=120))
    progress.prompt(1, 2)
    progress.phase("rollout")
    progress.bar.refresh()
    progress.step_done()
    progress.close()
    text = out.getvalue()
    assert "step" in text and "2/10" in text and "prompt 2/2" in text and "rollout" in text and "ETA" in text
    assert not StepProgress(10, 0, enabled=None, rank=0, console=Console(file=io.StringIO())).live
    assert not StepProgress(10, 0, enabled=True, rank=1).live


@pytest.mark.parametrize("gradient", ["response_only", "exact"])
def test_prompts_per_step_accumulate_into_one_step(gradient):
    """Two prompts in one optimizer step: the same update as one process summing both prompts' gradients and
    halving them (the data-parallel average, on one rank); exact: each prompt's walk follows its replays."""
    from longstraw_cli.distributed.local_strategy import LocalStrategy
    from longstraw_cli.models import build_model
    from longstraw_cli.resident.gradient import StateGrad
    from longstraw_cli.rl.advantages import get_advantage
    from longstraw_cli.rl.losses import LossConfig
    from longstraw_cli.telemetry.memory import PhaseClock
    from longstraw_cli.transaction import Transaction, TransactionConfig

    cfg = TransactionConfig(block_size=16, gradient=gradient)
    g = torch.Generator().manual_seed(0)
    problems = [(torch.randint(0, 259, (30 + 7 * b,), generator=g),
                 [torch.randint(0, 259, (4 + i,), generator=g) for i in range(3)], torch.rand(3, generator=g))
                for b in range(2)]

    def transaction():
        model = build_model("qwen36_tiny", dtype=torch.float64)
        randomize_(model, seed=1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, Transaction(model, LocalStrategy(model, optimizer, 0.5), LossConfig(name="grpo"), cfg)

    model, tx = transaction()
    tx.begin()
    clock = PhaseClock()
    parts = [tx.accumulate(p, r, w, tx.capture(p), clock=clock, prompt=b, num_prompts=2)
             for b, (p, r, w) in enumerate(problems)]
    result = tx.finish(parts, clock)

    want, ref = transaction()
    ref.strategy.zero_grad()
    for p, r, w in problems:
        resident = ref.capture(p)
        state_grad = StateGrad(resident) if cfg.exact else None
        ref.replay(resident, r, ref.score(resident, r), None, get_advantage(cfg.advantage)(w.double()).tolist(),
                   state_grad)
        if cfg.exact:
            want.prompt_backward(p, resident, state_grad, cfg.block_size)
    for param in want.parameters():
        param.grad /= 2
    norm = ref.finalize()
    ref.step()
    assert result.stats["grad_norm"] == pytest.approx(norm, rel=1e-12)
    assert result.stats["reward_mean"] == pytest.approx(float(torch.cat([w for *_, w in problems]).mean()))
    start = build_model("qwen36_tiny", dtype=torch.float64)
    randomize_(start, seed=1)
    for (name, got), expected in zip(model.named_parameters(), want.parameters()):
        assert rel_err(got - start.get_parameter(name), expected - start.get_parameter(name)) < 1e-10, name
