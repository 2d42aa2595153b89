"""Progress where there is no terminal: a phase running longer than logger.heartbeat_s says so, once per
heartbeat_s, on rank 0 (the rollout with its response tokens decoded so far); the native decode tells its progress
per step; the setting is checked."""

import logging
import time

import pytest
import torch

from conftest import composed
from longstraw_cli.config import ConfigError, train_config
from longstraw_cli.models import build_model
from longstraw_cli.rollout.native import NativeConfig, SamplingConfig, generate
from longstraw_cli.telemetry.progress import StepProgress


def lines_within(caplog, predicate, timeout_s=10.0):
    """The log lines matching `predicate`, waiting up to timeout_s for the first (the heartbeat is a thread)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [r.getMessage() for r in caplog.records if predicate(r.getMessage())]
        if found:
            return found
        time.sleep(0.02)
    return []


def test_a_long_phase_beats_with_its_step_and_the_rollouts_tokens(caplog):
    caplog.set_level(logging.INFO, logger="longstraw")
    progress = StepProgress(3, 1, enabled=False, rank=0, heartbeat_s=0.05)
    try:
        progress.phase("rollout")
        progress.count(5, 10)
        beats = lines_within(caplog, lambda m: "rollout running for" in m)
        assert beats and beats[0].startswith("step 1: rollout running for")
        assert "5 of 10 response tokens" in beats[0]
        progress.phase("replay")
        beats = lines_within(caplog, lambda m: "replay running for" in m)
        assert beats and "response tokens" not in beats[0]
        progress.step_done()
        caplog.clear()
        time.sleep(0.3)
        assert not [r for r in caplog.records if "running for" in r.getMessage()]
        progress.phase("capture")
        assert lines_within(caplog, lambda m: m.startswith("step 2: capture running for"))
    finally:
        progress.close()


@pytest.mark.parametrize("rank, heartbeat_s", [(1, 0.05), (0, 0.0)])
def test_no_heartbeat_off_rank_0_or_when_off(caplog, rank, heartbeat_s):
    caplog.set_level(logging.INFO, logger="longstraw")
    progress = StepProgress(3, 0, enabled=False, rank=rank, heartbeat_s=heartbeat_s)
    progress.phase("rollout")
    time.sleep(0.3)
    progress.close()
    assert not [r for r in caplog.records if "running for" in r.getMessage()]


def test_the_native_decode_tells_each_step():
    model = build_model("qwen36_tiny", seed=0)
    resident = model.capture(torch.randint(0, 259, (40,), generator=torch.Generator().manual_seed(2)), block_size=16)
    cfg = SamplingConfig(max_new_tokens=30, stop_token_ids=(1,))
    told = []
    rollout = generate(model, resident, 2, cfg, torch.Generator().manual_seed(3), NativeConfig(),
                       on_token=lambda done, total: told.append((done, total)))
    assert told == [(n, 30) for n in range(1, rollout.decode_steps + 1)]


def test_heartbeat_setting_is_checked():
    cfg = composed(["run_dir=x", "logger.heartbeat_s=5"])
    assert train_config(cfg).logger.heartbeat_s == 5.0
    assert train_config(composed(["run_dir=x"])).logger.heartbeat_s == 60.0
    for bad in (-1, "soon", True):
        with pytest.raises(ConfigError, match=rf"logger.heartbeat_s={bad!r}; valid: a number of seconds >= 0"):
            train_config({**cfg, "logger": {**cfg["logger"], "heartbeat_s": bad}})
