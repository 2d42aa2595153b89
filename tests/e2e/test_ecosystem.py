"""`longstraw train` as a verl or a TRL user runs it (docs/guide/verl-trl.md): a model directory with its tokenizer
and chat template, their data files as they are, their reward functions, several prompts per step, a validation
file, a schedule, TensorBoard, and the exported model loaded back by transformers and peft."""

import json
import sys

import pytest
import torch

from conftest import chat_model_dir, rows

FAST = ["group_size=2", "response_tokens=6", "logger.backends=[jsonl]"]
VERL_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # varies within a group: every step has a gradient; verl's extra keys: a number, a bool, a string
    acc = ground_truth in solution_str
    return {"score": float(acc) + sum(map(ord, solution_str)) / 1000, "length": len(solution_str), "acc": acc,
            "pred": solution_str[-3:]}
"""
TRL_REWARDS = """
def char_reward(completions, solution, **kwargs):
    # varies within a group: every step has a gradient
    return [sum(map(ord, c[0]["content"])) / 1000 + (s in c[0]["content"]) for c, s in zip(completions, solution)]

def nan_reward(response, example):
    return float("nan")
"""
DETERMINISTIC = ("reward_mean", "loss", "grad_norm", "entropy", "num_tokens", "step_prompt_tokens", "lr",
                 "val/reward_mean")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return chat_model_dir(tmp_path_factory.mktemp("chat_model"))


@pytest.fixture
def verl_files(tmp_path):
    import datasets

    def verl_rows(first, n):
        return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
                 "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
                 "extra_info": {"split": "train", "index": i}} for i in range(first, first + n)]

    datasets.Dataset.from_list(verl_rows(0, 6)).to_parquet(str(tmp_path / "train.parquet"))
    datasets.Dataset.from_list(verl_rows(10, 2)).to_parquet(str(tmp_path / "test.parquet"))
    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    return tmp_path


def verl_args(model_dir, files, run):
    return [f"model.path={model_dir}", "task=dataset", f"task.path={files / 'train.parquet'}",
            f"task.reward={files / 'verl_reward.py'}:compute_score", f"task.val_path={files / 'test.parquet'}",
            "task.val_every=2", "prompts_per_step=2", "optim.warmup_steps=2", "optim.schedule=cosine", *FAST,
            f"run_dir={run}"]


def test_verl_style_run(train_here, model_dir, verl_files, tmp_path):
    run = tmp_path / "run"
    code, _, err = train_here([*verl_args(model_dir, verl_files, run), "steps=2", "logger=tensorboard",
                               "logger.backends=[jsonl,tensorboard]", "logger.progress=true", "export_hf=true",
                               "logger.samples=3"])
    assert code == 0, err
    assert f"longstraw: tensorboard: event files in {run / 'tensorboard'}" in err
    # prompt_tokens was not set: no notice that it does not apply (tests/e2e/test_user_input.py sets it)
    assert "does not apply" not in err
    first, second = rows(run)
    # two chat prompts a step, each "<|im_start|>user\nWhat is i+i?<|im_end|>\n<|im_start|>assistant\n"
    assert first["step_prompt_tokens"] == second["step_prompt_tokens"] == 2 * 31
    assert first["num_tokens"] <= 2 * 2 * 6 and first["grad_norm"] > 0
    assert [first["lr"], second["lr"]] == [0.005, 0.01]
    assert "val/reward_mean" not in first and second["val/prompts"] == 2 and second["val/reward_mean"] > 0
    assert second["epoch"] == pytest.approx(4 / 6)
    assert any((run / "tensorboard").iterdir())
    # the reward's other numbers are metrics, the mean of the step's responses; a string is named once
    samples = rows(run, "samples.jsonl")
    for row in (first, second):
        step = [s for s in samples if s["step"] == row["step"]]
        assert 0 <= row["reward/acc"] <= 1 and row["reward/length"] > 0 and "reward/pred" not in row
        assert [s["step"] for s in step] == [row["step"]] * 3
    assert err.count("returns 'pred' = ") == 1 and "not logged as reward/pred" in err
    # three responses a step, of both prompts (two a prompt), with what they were judged against
    origins = [s["origin"] for s in samples[:3]]
    assert origins[0] == origins[1] != origins[2] and origins[2].startswith(f"{verl_files / 'train.parquet'} row ")
    for sample in samples:
        assert sample["prompt_tail"].endswith("<|im_start|>assistant\n") and "What is" in sample["prompt_tail"]
        assert sample["answer"] == str(2 * int(sample["prompt_tail"].split("What is ")[1].split("+")[0]))
        assert isinstance(sample["response"], str) and 1 <= sample["response_tokens"] <= 6
        assert isinstance(sample["reward"], float) and set(sample) >= {"reward/acc", "reward/length"}

    from transformers import AutoTokenizer, GenerationConfig

    hf = run / "hf"
    tokenizer = AutoTokenizer.from_pretrained(hf)
    assert len(tokenizer) == 259 and tokenizer.chat_template is not None
    # EOS and the template's end-of-turn, the tokens the rollout stopped at
    assert GenerationConfig.from_pretrained(hf).eos_token_id == [256, 258]


@pytest.mark.slow
def test_resume_with_shuffle_schedule_and_validation_equals_uninterrupted(train_here, model_dir, verl_files,
                                                                          tmp_path):
    common = ["checkpoint.every=1", "steps=3"]
    code, _, err = train_here([*verl_args(model_dir, verl_files, tmp_path / "whole"), *common])
    assert code == 0, err
    code, _, err = train_here([*verl_args(model_dir, verl_files, tmp_path / "cut"), *common[:1], "steps=2"])
    assert code == 0, err
    code, _, err = train_here([*verl_args(model_dir, verl_files, tmp_path / "cut"), *common, "resume=true"])
    assert code == 0, err
    for a, b in zip(rows(tmp_path / "cut"), rows(tmp_path / "whole"), strict=True):
        assert {k: a.get(k) for k in DETERMINISTIC} == {k: b.get(k) for k in DETERMINISTIC}


@pytest.fixture
def trl_files(tmp_path, monkeypatch):
    data = tmp_path / "trl.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Say {w}"}], "solution": w}) + "\n"
                            for w in "abcd"))
    (tmp_path / "trl_rewards.py").write_text(TRL_REWARDS)
    # `module:function` from the working directory (train_here runs in tmp_path), not on the path beforehand
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield data
    sys.modules.pop("trl_rewards", None)


def peft_error(base, merged_dir, adapter_dir) -> tuple[float, float]:
    """(max |logits of peft(base + adapter) - logits of the merged export|, the same for the bare base)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 2, 3, 100, 200, 250]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)(ids).logits
        bare = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)(ids).logits
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                          adapter_dir)
        adapted = model(ids).logits
    return (adapted - merged).abs().max().item(), (bare - merged).abs().max().item()


def test_trl_style_run_with_lora_exports_a_peft_adapter(train_here, model_dir, trl_files, tmp_path):
    run = tmp_path / "run"
    code, _, err = train_here([f"model.path={model_dir}", "task=jsonl", f"task.path={trl_files}",
                               "task.reward=trl_rewards:char_reward", "task.shuffle=true", "steps=2", "lora.rank=4",
                               "export_hf=true", *FAST, f"run_dir={run}"])
    assert code == 0, err
    assert all(r["grad_norm"] > 0 for r in rows(run))
    config = json.loads((run / "hf_adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["base_model_name_or_path"] == str(model_dir)
    adapted, bare = peft_error(model_dir, run / "hf", run / "hf_adapter")
    print(f"peft on the base vs merged export: {adapted:.1e} (the base alone: {bare:.1e})")
    assert adapted < 1e-5 < bare


def test_lora_on_a_named_shape_exports_its_base(train_here, tmp_path):
    run = tmp_path / "run"
    code, _, err = train_here(["prompt_tokens=64", "steps=1", "lora.rank=4", "export_hf=true", *FAST,
                               "task.reward=rewards_for_tests:char_sum", f"run_dir={run}"])
    assert code == 0, err
    from transformers import AutoTokenizer

    # the byte tokenizer as HF files: the same ids
    assert AutoTokenizer.from_pretrained(run / "hf").encode("héllo", add_special_tokens=False) == \
        list("héllo".encode())
    adapted, bare = peft_error(run / "hf_base", run / "hf", run / "hf_adapter")
    assert adapted < 1e-5 < bare


def test_bad_rewards_stop_with_one_line_and_write_nothing(train_here, model_dir, trl_files, tmp_path):
    weights_only = tmp_path / "weights_only"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        (weights_only / name).write_bytes((model_dir / name).read_bytes())
    run = tmp_path / "run"
    args = ["task=jsonl", f"task.path={trl_files}", "steps=1", *FAST, f"run_dir={run}"]
    # the signature: refused before the model is built
    code, _, err = train_here([*args, f"model.path={model_dir}", "task.reward=trl_rewards:char_reward",
                               "task.reward_style=verl"])
    assert code == 2 and "cannot be called as a verl reward" in err.strip().splitlines()[-1]
    assert not run.exists() or not any(run.glob("checkpoints/*"))
    # chat messages and a tokenizer without a chat template: refused at start, naming the row
    code, _, err = train_here([*args, f"model.path={weights_only}", "task.reward=trl_rewards:nan_reward"])
    assert code == 2 and f"{trl_files}:1: the byte tokenizer has no chat template" in err.strip().splitlines()[-1]
    # NaN: one line naming the reward and the row; no metrics row, no checkpoint
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "Say a", "answer": "a"}) + "\n")
    code, _, err = train_here([*args, f"task.path={plain}", f"model.path={weights_only}",
                               "task.reward=trl_rewards:nan_reward"])
    lines = err.strip().splitlines()
    assert code == 2 and f"reward 'trl_rewards:nan_reward' returned nan on {plain}:1" in lines[-1]
    assert any(f"model.path={weights_only} has no tokenizer files: using the byte tokenizer" in x for x in lines)
    assert not rows(run) and not any(run.glob("checkpoints/*"))
