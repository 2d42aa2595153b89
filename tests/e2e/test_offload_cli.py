"""`longstraw train capture.offload=cpu` end to end on CPU: the same metrics as `capture.offload=none`, exactly, for
both families (with a KL reference, LoRA and capture reuse too); what offload cannot run with is refused in one line
before any work, and so is a prompt whose pages do not fit in the host's available memory."""

from pathlib import Path

import pytest
import torch
from test_cli import cp2_case

from conftest import composed, rows

E2E = Path(__file__).parent
SMALL = ["prompt_tokens=48", "response_tokens=4", "group_size=3", "logger.backends=[jsonl]", "steps=2",
         "capture.block_size=16", "task.reward=rewards_for_tests:char_sum"]
# mem/graph_peak too: the replay's saved-tensor accounting sees the same graph (staged pages are not part of it)
DETERMINISTIC = ("step", "reward_mean", "reward_std", "loss", "pg_loss", "grad_norm", "entropy", "num_tokens",
                 "mem/resident", "mem/graph_peak")


@pytest.fixture
def train(train_here, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(E2E))

    def run(name: str, *args: str):
        code, _, err = train_here([*SMALL, *args, f"run_dir={tmp_path / name}"])
        return code, err, (rows(tmp_path / name) if code == 0 else None)

    return run


@pytest.mark.parametrize("args", [("model=qwen36_tiny",), ("model=glm52_tiny",),
                                  ("model=qwen36_tiny", "lora.rank=4", "algo.kl_coef=0.1"),
                                  ("model=qwen36_tiny", "capture.reuse_steps=2", "steps=3")])
def test_offloaded_run_equals_on_device_run(train, args):
    code, err, device = train("device", *args, "capture.offload=none")
    assert code == 0, err
    code, err, host = train("host", *args, "capture.offload=cpu")
    assert code == 0, err
    assert "capture.offload=cpu on device=cpu" in err
    assert [{k: r[k] for k in DETERMINISTIC} for r in device] == [{k: r[k] for k in DETERMINISTIC} for r in host]
    assert device[-1]["reward_mean"] == host[-1]["reward_mean"] and len(host) == len(device)


@pytest.mark.parametrize("args, message", [
    (("capture.offload=disk",), "offload='disk'; valid: ['none', 'cpu']"),
    (("capture.offload=cpu", "capture.gradient=exact"), "capture.offload=cpu with capture.gradient=exact"),
])
def test_offload_refusals(train, args, message):
    code, err, _ = train("bad", *args)
    assert code == 2 and message in err
    assert len([line for line in err.splitlines() if line.startswith("longstraw: error")]) <= 1


def test_offload_under_context_parallel_is_accepted():
    """cp > 1 takes capture.offload=cpu (each rank's shard in its host memory; tests/distributed/test_cp_offload.py
    compares it with on-device CP) in the trainer's config and in `longstraw plan`; exact gradients with offloaded
    pages stay refused at every cp, in one line naming the valid choices (cp > 1 needs torchrun, so asked here)."""
    from longstraw_cli.config import ConfigError, train_config
    from longstraw_cli.plan import plan
    from longstraw_cli.resident.offload import offload_refusal

    assert offload_refusal("cpu", gradient="response_only") is None
    assert offload_refusal("none", gradient="exact") is None
    refused = offload_refusal("cpu", gradient="exact")
    assert "capture.offload=cpu with capture.gradient=exact" in refused and "valid:" in refused
    for model in ("qwen36_tiny", "glm52_tiny"):
        cfg = composed([f"model={model}", "cp=2", "capture.offload=cpu", "run_dir=x"])
        assert train_config(cfg, world_size=2).transaction.placement == {"offload": "cpu"}
        with pytest.raises(ConfigError, match="capture.offload=cpu with capture.gradient=exact"):
            train_config(composed([f"model={model}", "cp=2", "capture.offload=cpu", "capture.gradient=exact",
                                   "strategy=ddp", "run_dir=x"]), world_size=2)
        assert plan(model, cp=2, prompt_tokens=1024, group_size=2, response_tokens=8, offload="cpu")["host"] > 0
        with pytest.raises(ValueError, match="capture.offload=cpu with capture.gradient=exact"):
            plan(model, cp=2, prompt_tokens=1024, group_size=2, response_tokens=8, offload="cpu", gradient="exact")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", ["qwen36", "glm52_ep2_reuse"])
def test_offloaded_context_parallel_run_equals_on_device_run(torchrun_once, case):
    """`torchrun --nproc-per-node 2 -m longstraw_cli train cp=2 capture.offload=cpu` logs the on-device CP run's
    metrics exactly (qwen36 with two capture blocks a shard; glm52 with expert parallel, a KL reference and capture
    reuse's drift probe too). The on-device runs are test_cli's test_cp2_train_step_matches_cp1 launches (fp64),
    shared through `torchrun_once`."""
    _, args = cp2_case(case)
    device, host = rows(torchrun_once(args)), rows(torchrun_once([*args, "capture.offload=cpu"]))
    keys = DETERMINISTIC + (("drift",) if "capture.reuse_steps=2" in args else ())
    assert [{k: r[k] for k in keys} for r in device] == [{k: r[k] for k in keys} for r in host]
    assert len(host) == (3 if "steps=3" in args else 2)


def test_not_enough_host_memory_stops_before_any_work(train, monkeypatch, tmp_path):
    import longstraw_cli.trainer as trainer

    monkeypatch.setattr(trainer, "host_available_bytes", lambda: 1000)
    code, err, _ = train("small_host", "capture.offload=cpu")
    assert code == 2 and "pages need" in err and "GiB of host memory" in err and "capture.offload=none" in err
    assert not (tmp_path / "small_host" / "metrics.jsonl").exists()
    # every rank on the host keeps its (context-parallel shard of the) pages in the same memory: counted all
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    code, err, _ = train("two_local", "capture.offload=cpu")
    assert code == 2 and "(2 ranks' shards of 47 tokens on this host)" in err
    # offload=none never asks
    code, err, _ = train("no_offload", "capture.offload=none", "steps=1")
    assert code == 0, err


@pytest.mark.parametrize("args", [("model=qwen36_tiny", "capture.offload=cpu"),
                                  ("model=glm52_tiny", "capture.offload=cpu", "capture.reuse_steps=2"),
                                  ("model=qwen36_tiny", "lora.rank=4", "capture.reuse_steps=2")])
def test_a_step_leaves_nothing_for_the_cycle_collector(tmp_path, monkeypatch, args):
    """Every object a step makes is freed by reference counting when the step is done. On a GPU a tensor caught in
    a reference cycle stays allocated until Python's cycle collector happens to run: an offloaded replay's staged
    pages once did (an H200 run's peak rose ~0.5 GiB a step until a collection)."""
    import gc

    from longstraw_cli.config import train_config
    from longstraw_cli.trainer import Trainer

    monkeypatch.syspath_prepend(str(E2E))
    trainer = Trainer(train_config(composed([*SMALL, *args, "steps=3", f"run_dir={tmp_path}"])))
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for step in range(3):
            trainer.iteration(step)
        gc.collect()
        ours = [o for o in gc.garbage
                if torch.is_tensor(o) or type(o).__module__.startswith("longstraw")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
        trainer.progress.close()
        trainer.metrics.close()
    assert not ours, sorted({type(o).__name__ for o in ours})
