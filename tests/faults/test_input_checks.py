"""Bad input stops the run with one line naming it, exit 2, no traceback (HYDRA_FULL_ERROR=1 keeps it): at load,
not at step N. Every set-up error the issue found as a traceback, typed booleans and integers, rewards that do not
return a number, and jsonl rows that are empty or longer than the model's positions."""

import json
from pathlib import Path

import pytest
import torch

E2E = Path(__file__).parent.parent / "e2e"
SMALL = ["prompt_tokens=64", "response_tokens=4", "group_size=2", "logger.backends=[jsonl]", "steps=1"]


def one_line(train_here, args: list[str], expected: str) -> None:
    code, _, err = train_here(args)
    assert code == 2, err
    lines = err.strip().splitlines()
    # a notice (a setting that does not apply to the task) may come first: the one error line is the last
    errors = [line for line in lines if line.startswith("longstraw: error:")]
    assert errors == lines[-1:] and "Traceback" not in err and expected in lines[-1], err


@pytest.mark.parametrize("override, expected", [
    ("resume=no", "resume='no' must be true or false or auto"),
    ("export_hf=no", "export_hf='no' must be true or false"),
    ("rollout.native.compile=1", "rollout.native.compile=1 must be true or false"),
    ("capture.block_size=1.5", "capture.block_size=1.5 must be an integer"),
    ("seed=abc", "seed='abc' must be an integer"),
    ("optim.lr=fast", "optim.lr='fast' must be a number"),
    ("optim.betas=[0.9,fast]", "optim.betas=[0.9, 'fast'] must be a list of 2 numbers"),
    ("group_size=1e9", "group_size must be an integer >= 2, got 1000000000.0"),
    ("dist_timeout_s=0", "dist_timeout_s must be a finite number of seconds > 0, got 0"),
])
def test_wrong_types_and_values_name_key_and_value(train_here, tmp_path, override, expected):
    one_line(train_here, [*SMALL, override, f"run_dir={tmp_path / 'run'}"], expected)


def test_a_group_too_large_for_memory_is_one_line(train_here, tmp_path):
    # 10**12 responses: the first allocation fails at once (10**9 fails the same way, after filling 8 GB)
    one_line(train_here, [*SMALL, f"group_size={10**12}", f"run_dir={tmp_path / 'run'}"],
             "out of memory at step 0, phase rollout")


@pytest.mark.parametrize("phase, replay_block, names_blocks", [
    ("replay", 0, True), ("score", 0, True), ("replay", 256, False), ("rollout", 0, False), (None, 0, False)])
def test_out_of_memory_in_a_whole_replay_points_at_replay_block(phase, replay_block, names_blocks):
    """Long responses run out in the replay (its graph grows with the response) or the scoring: there the advice
    names capture.replay_block first; elsewhere, or with blocks already, the sizes to lower."""
    from types import SimpleNamespace

    from longstraw_cli.trainer import Trainer

    cfg = SimpleNamespace(group_size=8, response_tokens=32768,
                          transaction=SimpleNamespace(replay_block=replay_block))
    advice = Trainer._memory_advice(SimpleNamespace(cfg=cfg), phase)
    assert ("capture.replay_block=N" in advice) == names_blocks
    assert "lower group_size=8, response_tokens, prompt_tokens or capture.block_size" in advice
    if names_blocks:
        assert advice.startswith("whole responses of response_tokens=32768: capture.replay_block=N replays and "
                                 "scores them in blocks of N tokens, or lower group_size=8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line(train_here, tmp_path):
    one_line(train_here, [*SMALL, "device=cuda", f"run_dir={tmp_path / 'run'}"],
             "device='cuda', but this process sees 0 CUDA device(s); valid: ['cpu']")


def test_a_run_dir_that_is_a_file_is_one_line(train_here, tmp_path):
    (tmp_path / "taken").write_text("")
    one_line(train_here, [*SMALL, f"run_dir={tmp_path / 'taken'}"], "is a file, not a directory")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from longstraw_cli.export import export_hf
    from longstraw_cli.models import build_model

    path = tmp_path_factory.mktemp("hf")
    export_hf(build_model("qwen36_tiny"), path)
    return path


def _broken(hf_dir: Path, tmp_path: Path, how: str) -> Path:
    import shutil

    path = Path(shutil.copytree(hf_dir, tmp_path / "hf"))
    config = json.loads((path / "config.json").read_text())
    if how == "model_type":
        (path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    elif how == "invalid":
        (path / "config.json").write_text("{\"model_type\": ")
    elif how == "incomplete":
        (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "hidden_size"}))
    else:
        weights = path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:4096])
    return path


@pytest.mark.parametrize("how, expected", [
    ("model_type", "model_type 'llama' is not a checkpoint LongStraw reads; valid:"),
    ("invalid", "cannot use its config.json (Expecting value"),
    ("incomplete", "its config.json lacks 'hidden_size'"),
    ("truncated", "model.safetensors: not a readable safetensors file"),
])
def test_a_broken_model_directory_is_one_line_naming_the_file(train_here, tmp_path, hf_dir, how, expected):
    path = _broken(hf_dir, tmp_path, how)
    one_line(train_here, [*SMALL, f"model.path={path}", f"run_dir={tmp_path / 'run'}"], expected)
    if how == "truncated":
        code, _, err = train_here([*SMALL, f"model.path={path}", f"run_dir={tmp_path / 'run2'}"])
        assert str(path / "model.safetensors") in err


def test_a_reward_that_returns_a_string_is_one_line_naming_it(train_here, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(E2E))
    one_line(train_here, [*SMALL, "task.reward=rewards_for_tests:as_string", f"run_dir={tmp_path / 'run'}"],
             "reward 'rewards_for_tests:as_string' returned '0.5' on example 0, a str; a reward must return a finite "
             "number")


def test_hydra_full_error_keeps_the_traceback_of_a_trainer_error(train_here, tmp_path, monkeypatch):
    from longstraw_cli.safety.inputs import InputError

    monkeypatch.syspath_prepend(str(E2E))
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(InputError, match="returned '0.5'"):
        train_here([*SMALL, "task.reward=rewards_for_tests:as_string", f"run_dir={tmp_path / 'run'}"])


@pytest.mark.parametrize("row, expected", [
    # qwen36_tiny has 65,536 positions: a 70,000-byte prompt does not fit (the byte tokenizer: a token a byte)
    ({"prompt": "x" * 70_000, "answer": "a"}, "the prompt is 70000 tokens; with response_tokens=4 the model's 65536 "
                                              "positions leave room for 65532"),
    ({"prompt": "", "answer": "a"}, "the prompt is empty (0 tokens)"),
])
def test_jsonl_rows_are_checked_at_load(train_here, tmp_path, row, expected):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n\n" + json.dumps(row) + "\n")
    one_line(train_here, [*SMALL, "task=jsonl", f"task.path={data}", f"run_dir={tmp_path / 'run'}"],
             f"{data}:3: {expected}")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
