"""`longstraw train capture.replay_block=N`: long responses replayed (and scored) in blocks, end to end. The run
logs the whole-response replay's metrics (loss, grad norm, KL to a reference scored in blocks; fp32, so to float
noise) with a smaller accounted graph, and bad settings are refused with one line."""

import pytest

from conftest import composed, rows
from longstraw_cli.config import ConfigError

LONG = ["prompt_tokens=128", "response_tokens=64", "group_size=3", "steps=2", "algo.kl_coef=0.05",
        "rollout.temperature=1.5", "logger.backends=[jsonl]", "checkpoint.enabled=false"]
SAME = ("loss", "pg_loss", "kl_loss", "grad_norm", "reward_mean", "num_tokens")


def test_long_responses_in_blocks_log_the_whole_replays_metrics(train_here, tmp_path):
    code, _, err = train_here([*LONG, f"run_dir={tmp_path / 'whole'}"])
    assert code == 0, err
    code, _, err = train_here([*LONG, "capture.replay_block=16", f"run_dir={tmp_path / 'blocks'}"])
    assert code == 0, err
    whole, blocks = rows(tmp_path / "whole"), rows(tmp_path / "blocks")
    assert len(whole) == len(blocks) == 2
    for a, b in zip(whole, blocks):
        # responses several blocks long
        assert b["num_tokens"] > 3 * 2 * 16
        for key in SAME:
            # fp32: the GDN rule's chunked form runs over other chunks (blocks of 16 against one chunk of 64), which
            # moves qwen36_tiny's fp32 gradient by ~1e-4 (fp64: 1e-14, tests/models/test_blockwise_replay.py)
            assert b[key] == pytest.approx(a[key], rel=2e-3, abs=1e-6), key
        assert b["mem/response_state"] > 0 and "mem/response_state" not in a
        # (on CPU the torch chunked GDN pads a block to 64 tokens: the graph is smaller, not 4x smaller, here;
        # tests/models/test_blockwise_replay.py measures its growth with the response)
        assert b["mem/graph_peak"] < a["mem/graph_peak"]
        print(f"graph peak: whole {a['mem/graph_peak']} B, blocks of 16 {b['mem/graph_peak']} B "
              f"(+ response state {b['mem/response_state']} B), {b['num_tokens']:.0f} response tokens")


def test_replay_block_refuses_what_it_does_not_run_with():
    from longstraw_cli.config import train_config

    cfg = composed(["capture.replay_block=64", "run_dir=x"])
    assert train_config(cfg).transaction.replay_block == 64
    with pytest.raises(ConfigError, match="strategy=ddp only with data parallelism; got strategy='fsdp2'"):
        train_config({**cfg, "strategy": {"name": "fsdp2"}}, world_size=2)
    with pytest.raises(ConfigError, match="needs lora.dropout=0, got lora.dropout=0.1"):
        train_config({**cfg, "lora": {**cfg["lora"], "rank": 4, "dropout": 0.1}})
    with pytest.raises(ConfigError, match="replay_block must be an integer >= 0"):
        train_config({**cfg, "capture": {**cfg["capture"], "replay_block": -1}})
