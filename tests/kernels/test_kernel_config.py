"""The kernel choices as config (`kernels:` in conf/config.yaml, longstraw_kernels/config.py): every op's choice
shown by `--cfg job`, checked at start (one line, exit 2), put in force by the trainer, and read by the ops (no
environment variable is)."""

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

from conftest import composed
from longstraw_cli.config import train_config
from longstraw_kernels import KernelConfig, kernel_choice, kernels, use_kernels
from longstraw_kernels.config import ATTENTION_CHOICES

REPO = Path(__file__).resolve().parents[2]
OPS = [f.name for f in dataclasses.fields(KernelConfig) if f.name != "autotuned"]


def test_every_op_defaults_to_auto_and_refuses_a_bad_choice_naming_the_valid_ones():
    assert all(getattr(KernelConfig(), op) == "auto" for op in OPS) and KernelConfig().autotuned is True
    for op in OPS:
        valid = list(ATTENTION_CHOICES) if op == "attention" else ["auto", "torch"]
        with pytest.raises(ValueError, match=re.escape(f"kernels.{op}='fast'; valid: {valid}")):
            KernelConfig(**{op: "fast"})
    with pytest.raises(ValueError, match=r"kernels.autotuned='no'; valid: \[true, false\]"):
        KernelConfig(autotuned="no")


def test_use_kernels_puts_choices_in_force_and_a_with_block_restores_them():
    assert kernel_choice("mla") == "auto"
    with use_kernels(mla="torch", sampling="torch"):
        assert kernel_choice("mla") == kernel_choice("sampling") == "torch" and kernel_choice("dsa") == "auto"
        with use_kernels(KernelConfig(dsa="torch")):
            assert kernel_choice("dsa") == "torch" and kernel_choice("mla") == "auto"
        assert kernel_choice("mla") == "torch"
    assert kernels() == KernelConfig()


@pytest.mark.parametrize("args, expected", [
    (["kernels.mla=cuda"], "kernels.mla='cuda'; valid: ['auto', 'torch']"),
    (["kernels.attention=triton"], "kernels.attention='triton'; valid: ['auto', 'cudnn', 'flash', 'flash_attn']"),
    (["kernels.autotuned=maybe"], "kernels.autotuned='maybe' must be true or false"),
    (["kernels.decode_pages=varlen"], "unknown config key 'kernels.decode_pages'"),
])
def test_a_bad_kernel_choice_is_one_line_and_exit_2(train_here, tmp_path, args, expected):
    code, _, err = train_here([*args, f"run_dir={tmp_path / 'run'}"])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expected in lines[0], err


def test_cfg_job_shows_every_choice_and_the_config_carries_them(train_here, tmp_path):
    code, out, _ = train_here(["--cfg", "job", "kernels.dsa=torch"])
    assert code == 0
    section = out[out.index("kernels:"):]
    for op in OPS:
        assert re.search(rf"^  {op}: {'torch' if op == 'dsa' else 'auto'}$", section, re.M), op
    cfg = train_config(composed([f"run_dir={tmp_path}", "kernels.router=torch", "kernels.autotuned=false"]))
    assert cfg.kernels == KernelConfig(router="torch", autotuned=False)
    # as_dict is what a checkpoint and the run's metrics record
    assert cfg.as_dict()["kernels"]["router"] == "torch"


def test_the_trainer_puts_the_runs_choices_in_force(tmp_path):
    from longstraw_cli.trainer import Trainer

    cfg = train_config(composed([f"run_dir={tmp_path}", "steps=1", "kernels.sampling=torch", "kernels.gdn=torch"]))
    Trainer(cfg)
    assert kernels() == KernelConfig(sampling="torch", gdn="torch")


def test_no_kernel_choice_is_read_from_the_environment():
    """The package's environment variables are the launcher's alone (the slurm outcome dir)."""
    grep = subprocess.run(["grep", "-rhoE", "LONGSTRAW_[A-Z0-9_]+", "longstraw_cli", "longstraw_kernels"],
                          cwd=REPO, capture_output=True, text=True)
    # 0: found some, 1: none; anything else (no grep, no such directory) proves nothing
    assert grep.returncode in (0, 1), grep.stderr
    found = grep.stdout.split()
    assert set(found) <= {"LONGSTRAW_OUTCOME_DIR"}, sorted(set(found))


def test_say_once_logs_a_line_once_by_its_key_at_its_level(caplog):
    """A line is said once however often it is asked; one whose text varies (a count) is one line by its key; the
    level is a warning unless the caller says otherwise."""
    import logging

    from longstraw_kernels import say_once

    say_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="longstraw_kernels"):
        for n in range(3):
            say_once("a fast path does not serve")
            say_once(f"{n} rows took the slow rule", key="slow rows", level=logging.INFO)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "a fast path does not serve"), (logging.INFO, "0 rows took the slow rule")]
    say_once.cache_clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="longstraw_kernels"):
        say_once("a fast path does not serve")
    assert len(caplog.records) == 1
