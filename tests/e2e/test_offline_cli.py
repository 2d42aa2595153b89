"""`longstraw train` on responses from data and without a decode (docs/guide/offline.md): TRL's prompt-completion
JSON Lines with a model directory's chat template (algo=sft, LoRA), our grouped parquet rows with rewards (offline
GRPO), synthetic responses (algo=sft, blocks, exact); bad rows are one line, exit 2, no run dir; the guide's GPU
rows make one command each, which `longstraw plan` plans without a rollout phase within one H200."""

import json
import re
import shlex
from pathlib import Path

import pytest

from conftest import chat_model_dir, composed, rows

FAST = ["response_tokens=16", "logger.backends=[jsonl]", "checkpoint.enabled=false"]
GUIDE = Path(__file__).parents[2] / "docs" / "guide" / "offline.md"
CHAT = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return chat_model_dir(tmp_path_factory.mktemp("chat_model"))


def write_jsonl(path: Path, rows_: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return path


def test_sft_on_trl_prompt_completion_rows_with_lora(train_here, model_dir, tmp_path):
    """One row a completion, two rows a prompt: each completion is the template's continuation, "4<|im_end|>" (the
    model directory's end-of-turn is a stop token: the newline after it is not trained)."""
    other = [{"role": "user", "content": "What is 3+3?"}]

    def answer(text):
        return [{"role": "assistant", "content": text}]

    data = write_jsonl(tmp_path / "sft.jsonl", [
        {"prompt": CHAT, "completion": answer("4")}, {"prompt": other, "completion": answer("6")},
        {"prompt": CHAT, "completion": answer("four")}, {"prompt": other, "completion": answer("6!")},
    ])
    code, _, err = train_here([f"model.path={model_dir}", "task=jsonl", f"task.path={data}", "rollout=data",
                               "algo=sft", "group_size=2", "steps=2", "lora.rank=4", *FAST,
                               f"run_dir={tmp_path / 'run'}"])
    assert code == 0, err
    got = rows(tmp_path / "run")
    assert [r["step_response_tokens"] for r in got] == [2 + 5, 2 + 3]
    assert all(r["loss"] > 0 and r["ratio_mean"] == 1.0 and r["grad_norm"] > 0 for r in got)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples[0]["response"] == "4" and "time/rollout" in got[0] and "decode_steps" not in got[0]


def test_offline_grpo_on_grouped_parquet_rows_uses_their_rewards(train_here, tmp_path):
    import datasets

    path = tmp_path / "given.parquet"
    datasets.Dataset.from_list([
        {"prompt": "Pick one of abcd:", "responses": ["a", "b", "cc"], "rewards": [1.0, 0.0, 0.5]},
        {"prompt": "Say x:", "responses": ["x", "y", "x!"], "rewards": [1.0, 0.0, 0.75]},
    ]).to_parquet(str(path))
    code, _, err = train_here(["task=dataset", f"task.path={path}", "task.shuffle=false", "rollout=data",
                               "group_size=3", "steps=2", *FAST, f"run_dir={tmp_path / 'run'}"])
    assert code == 0, err
    got = rows(tmp_path / "run")
    assert [r["reward_mean"] for r in got] == pytest.approx([0.5, 1.75 / 3])
    # plain text: its bytes and EOS
    assert [r["step_response_tokens"] for r in got] == [2 + 2 + 3, 2 + 2 + 3]


def test_one_capture_serves_a_group_for_reuse_steps(train_here, tmp_path):
    """capture.reuse_steps=2: each group trains two steps on one capture (two epochs of it)."""
    data = write_jsonl(tmp_path / "given.jsonl", [{"prompt": "Pick one of abcd:", "responses": ["a", "b"]},
                                                  {"prompt": "Say x:", "responses": ["x", "yy"]}])
    code, _, err = train_here(["task=jsonl", f"task.path={data}", "task.reward=prefix", "rollout=data",
                               "group_size=2", "steps=4", "capture.reuse_steps=2", *FAST,
                               f"run_dir={tmp_path / 'run'}"])
    assert code == 0, err
    got = rows(tmp_path / "run")
    assert [(r["captures"], r["reuse_cycle"], r["step_response_tokens"]) for r in got] == [
        (1, 0, 4), (0, 1, 4), (1, 0, 5), (0, 1, 5)]


@pytest.mark.parametrize("row, expected", [
    ({"prompt": "p", "responses": ["a", ""]}, "'responses' response 1 is empty"),
    ({"prompt": "p", "responses": ["a", "b" * 20]}, "response 1: the response is 21 tokens, over response_tokens=16 "
                                                    "(raise it, or shorten the response)"),
])
def test_a_bad_row_is_one_line_exit_2_and_no_run_dir(train_here, tmp_path, row, expected):
    data = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "q", "responses": ["a", "b"]}, row])
    code, _, err = train_here(["task=jsonl", f"task.path={data}", "rollout=data", "group_size=2", *FAST,
                               f"run_dir={tmp_path / 'run'}"])
    lines = [line for line in err.splitlines() if line.startswith("longstraw: error:")]
    assert code == 2 and len(lines) == 1 and expected in lines[0] and "bad.jsonl:2" in lines[0], err
    assert not (tmp_path / "run").exists()


def test_synthetic_responses_train_sft_in_blocks_with_the_exact_gradient(train_here, tmp_path):
    code, _, err = train_here(["rollout=synthetic", "algo=sft", "prompt_tokens=64",
                               "group_size=2", "steps=2", "capture.replay_block=5", "capture.gradient=exact", *FAST,
                               f"run_dir={tmp_path / 'run'}"])
    assert code == 0, err
    got = rows(tmp_path / "run")
    assert [r["step_response_tokens"] for r in got] == [32, 32] and all(r["loss"] > 0 for r in got)
    assert got[0]["loss"] != got[1]["loss"] and "time/prompt" in got[0]



def test_sft_groups_of_one_log_no_spread_and_no_warning(train_here, tmp_path):
    code, _, err = train_here(["rollout=synthetic", "algo=sft", "prompt_tokens=64", "group_size=1",
                               "response_tokens=8", "steps=1", *FAST, f"run_dir={tmp_path / 'run'}"])
    assert code == 0, err
    assert rows(tmp_path / "run")[0]["reward_std"] == 0.0 and "degrees of freedom" not in err

def guide_rows() -> list[list[str]]:
    """The guide's GPU rows: its bash commands with rollout=synthetic and the 27B shape."""
    text = GUIDE.read_text()
    lines = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line, comments=True)[2:] for line in lines
            if "rollout=synthetic" in line and "model=qwen36 " in line and line.startswith("longstraw train")]


def test_the_guides_gpu_rows_are_one_command_each_and_plan_within_one_h200():
    from omegaconf import OmegaConf

    from longstraw_cli import plan as planner
    from longstraw_cli.cli import plan_arguments
    from longstraw_cli.config import parse_tokens, train_config

    commands = guide_rows()
    assert len(commands) == 2, commands
    shapes = set()
    for command in commands:
        # what `longstraw plan` does with K and M before Hydra composes
        args = [a if not a.startswith(("prompt_tokens=", "response_tokens=")) else
                f"{a.partition('=')[0]}={parse_tokens(a.partition('=')[2], a.partition('=')[0])}"
                for a in command if not a.startswith("device=")]
        cfg = train_config({**composed(args), "run_dir": "runs/x"})
        shapes.add((cfg.prompt_tokens, cfg.response_tokens, cfg.group_size, cfg.lora.rank))
        model_cfg, _, common = plan_arguments(OmegaConf.create(composed(args)), gpu_mem_gib=139, host_mem_gib=128)
        plan = planner.plan(model_cfg, prompt_tokens=cfg.prompt_tokens, **common)
        assert not common["decode"] and "rollout" not in plan["phases"] and plan["fits"], command
    assert shapes == {(262144, 32768, 8, 16), (786432, 8192, 8, 16)}
