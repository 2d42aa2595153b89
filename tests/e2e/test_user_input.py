"""What a user types: paths with `~` and environment variables, token counts with K/M, and the docs' own
commands, which must pass the CLI's checks as printed (read from README.md and docs/guide/*.md, so the docs cannot
drift)."""

import re
import shlex
from pathlib import Path

import pytest

from conftest import composed, rows
from longstraw_cli.cli import _check_run_dir, _run_dir, check_overrides, parse_train_argv
from longstraw_cli.config import ConfigError, parse_tokens, train_config

REPO = Path(__file__).resolve().parents[2]


def typed(args: list[str], **replace):
    """train_config of `longstraw train ARGS` as the CLI composes it (its quoting of `~` paths included), with
    top-level values replaced after composition (as a YAML file could give them)."""
    argv, _ = parse_train_argv(args)
    d = composed(argv)
    # run_dir=null is Hydra's output dir, which the CLI fills in
    return train_config({**d, "run_dir": d["run_dir"] or "runs/x", **replace})


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LONGSTRAW_DATA", str(tmp_path / "data"))
    monkeypatch.delenv("LONGSTRAW_UNSET", raising=False)
    return tmp_path


def test_path_keys_take_home_and_environment_variables(home):
    cfg = typed(["task=dataset", "task.path=~/data/train.parquet", "task.val_path=$LONGSTRAW_DATA/test.parquet",
                 "task.reward=~/rewards.py:compute_score", "model.tokenizer=~/tokenizer",
                 "model.chat_template=$LONGSTRAW_DATA/chat.jinja", "run_dir=~/runs/a", "logger=wandb",
                 "+logger.wandb.dir=$LONGSTRAW_DATA/wandb"])
    data = home / "data"
    assert (cfg.task.path, cfg.task.val_path) == (str(data / "train.parquet"), str(data / "test.parquet"))
    assert cfg.reward == f"{home}/rewards.py:compute_score"
    assert (cfg.model.tokenizer, cfg.model.chat_template) == (str(home / "tokenizer"), str(data / "chat.jinja"))
    assert (cfg.run_dir, cfg.logger.wandb.dir) == (str(home / "runs" / "a"), str(data / "wandb"))
    # ${VAR} reaches the config from a YAML file (Hydra reads it in an override as a reference to a key)
    assert typed([], run_dir="${LONGSTRAW_DATA}/run").run_dir == str(data / "run")
    # a template given as its text keeps its `~` (Jinja's concatenation) and `$`
    template = "{{ messages[0]['content'] ~ '$LONGSTRAW_DATA' }}"
    assert typed([f"model.chat_template={template!r}"]).model.chat_template == template
    with pytest.raises(ConfigError, match=re.escape(f"model.path={str(home / 'ckpt')!r} is not an HF model")):
        typed(["model.path=~/ckpt"])
    with pytest.raises(ConfigError, match=re.escape("task.path='$LONGSTRAW_UNSET/x.jsonl': the environment "
                                                    "variable 'LONGSTRAW_UNSET' is not set")):
        typed(["task=jsonl", "task.path=$LONGSTRAW_UNSET/x.jsonl"])


def test_run_dir_is_expanded_before_hydra_too(home):
    """cli.py reads run_dir before Hydra (its lock, a file in its place) and Hydra writes .hydra/ there: both
    expand it as train_config does."""
    argv, args = parse_train_argv(["run_dir=~/runs/b"])
    assert _run_dir("~/runs/b") == str(home / "runs" / "b")
    (home / "runs").mkdir()
    (home / "runs" / "b").write_text("")
    assert _check_run_dir(args.overrides) == f"run_dir={str(home / 'runs' / 'b')!r} is a file, not a directory"
    assert "LONGSTRAW_UNSET" in _check_run_dir(["run_dir=$LONGSTRAW_UNSET/x"])


@pytest.mark.slow
def test_a_file_task_in_home_trains_and_says_prompt_tokens_does_not_apply(train_here, home):
    """`~` in task.path and run_dir as a shell passes them: the run reads the file and writes where `~` points
    (Hydra's .hydra/ and log too, no `./~`); prompt_tokens set with a K suffix is named as not applying (unset, it
    is not: tests/e2e/test_ecosystem.py)."""
    (home / "data").mkdir()
    (home / "data" / "train.jsonl").write_text('{"prompt": "Pick one of abcd:", "answer": "a"}\n')
    code, _, err = train_here(["task=jsonl", "task.path=~/data/train.jsonl", "run_dir=~/runs/a", "steps=1",
                               "group_size=2", "prompt_tokens=2K", "response_tokens=4", "logger.backends=[jsonl]"])
    assert code == 0, err
    run = home / "runs" / "a"
    assert len(rows(run)) == 1 and (run / ".hydra").is_dir() and not (home / "~").exists()
    assert "prompt_tokens=2048 does not apply to task=jsonl" in err


@pytest.mark.parametrize("value, tokens", [(4096, 4096), ("4096", 4096), ("2K", 2048), ("64k", 65536),
                                           ("1M", 1048576), ("2M", 2097152)])
def test_token_counts_take_k_and_m(value, tokens):
    assert parse_tokens(value, "prompt_tokens") == tokens


@pytest.mark.parametrize("value", ["2X", "1.5M", "K", "", "-2K", True, 2.0])
def test_a_bad_token_count_is_one_line(value):
    with pytest.raises(ConfigError, match=re.escape(f"prompt_tokens={value!r} is not a token count; e.g. 65536, "
                                                    f"64K, 2M (K = 1024, M = 1048576)")):
        parse_tokens(value, "prompt_tokens")


def test_train_takes_token_counts_as_plan_does():
    cfg = typed(["prompt_tokens=2K", "response_tokens=1K"])
    assert (cfg.prompt_tokens, cfg.response_tokens, cfg.task.prompt_tokens) == (2048, 1024, 2048)
    with pytest.raises(ConfigError, match="response_tokens='1G' is not a token count"):
        typed(["response_tokens=1G"])
    with pytest.raises(ConfigError, match="exceeds the model's 65536 positions"):
        typed(["prompt_tokens=1M"])


# the pages whose commands are checked: the README and every page of the user guide
DOCS = [REPO / "README.md", *sorted((REPO / "docs" / "guide").glob("*.md"))]
VERL_REWARD = "task.reward=verl_reward.py:compute_score"
TRL_REWARD = "task.reward=my_rewards:accuracy_reward"


def doc_train_commands() -> dict[str, list[list[str]]]:
    """The arguments of every `longstraw train` / `-m longstraw_cli train` command in the bash blocks and inline
    code of each page of DOCS, split as a shell splits them, by page (its path relative to the repository)."""
    return {str(page.relative_to(REPO)): train_commands(page.read_text()) for page in DOCS}


def train_commands(text: str) -> list[list[str]]:
    lines = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    # inline: the commands whose arguments are all overrides (`longstraw train [overrides]` describes the form)
    lines += [inline.replace("\n", " ") for inline in re.findall(r"`(longstraw train [^`]*)`", text)
              if all("=" in word for word in inline.split()[2:])]
    commands = []
    for line in lines:
        words = shlex.split(line, comments=True)
        at = [i for i, w in enumerate(words[1:], 1) if w == "train" and words[i - 1] in ("longstraw", "longstraw_cli")]
        if at:
            commands.append(words[at[0] + 1:])
    return commands


def test_the_docs_hold_the_commands_a_user_starts_from():
    """The README shows the trainer in a few commands (a verl one among them); the guide's pages hold their own,
    the verl and TRL commands of docs/guide/verl-trl.md with them."""
    pages = doc_train_commands()
    assert len(pages["README.md"]) >= 8, pages["README.md"]
    assert sum(map(len, pages.values())) >= 30, pages
    guide = pages["docs/guide/verl-trl.md"]
    assert [VERL_REWARD in c for c in guide].count(True) == [TRL_REWARD in c for c in guide].count(True) == 1, guide
    assert any(VERL_REWARD in c for c in pages["README.md"]), pages["README.md"]


def test_the_docs_train_commands_pass_the_clis_checks():
    """Every command as printed passes what `longstraw train` checks before Hydra (keys, group options, the
    grammar); the verl and TRL ones are composed into a TrainConfig below."""
    for page, commands in doc_train_commands().items():
        for command in commands:
            _, args = parse_train_argv(command)
            assert check_overrides(args.overrides, multirun=args.multirun) is None, (page, command)


def test_the_docs_verl_and_trl_commands_make_a_config(home):
    """Their files, model directory and GPU are the user's: without model.path and device, the rest of each
    makes a TrainConfig, with `~` expanded."""
    commands = [c for page in doc_train_commands().values() for c in page]
    verl = [c for c in commands if VERL_REWARD in c]
    trl = [c for c in commands if TRL_REWARD in c]
    assert verl and trl, commands
    for command in verl + trl:
        cfg = typed([arg for arg in command if not arg.startswith(("model.path=", "device="))])
        assert cfg.task.name == "dataset" and "~" not in cfg.task.path, command
        if command in verl:
            assert cfg.reward == VERL_REWARD.partition("=")[2]
            assert cfg.task.path == str(home / "data" / "gsm8k" / "train.parquet")
            if any(arg.startswith("task.val_path=") for arg in command):
                assert cfg.task.val_path == str(home / "data" / "gsm8k" / "test.parquet") and cfg.task.val_every
        else:
            assert cfg.reward == TRL_REWARD.partition("=")[2]
            assert cfg.task.chat_template_kwargs == {"enable_thinking": False}
    # the full commands of the guide: validation, a schedule, a logger, the export
    [full_verl] = [c for c in verl if any(arg.startswith("task.val_path=") for arg in c)]
    assert typed([a for a in full_verl if not a.startswith(("model.path=", "device="))]).export_hf
