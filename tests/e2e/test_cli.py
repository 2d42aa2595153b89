"""`longstraw train` end to end: good and bad input, Hydra behaviour, resume after a kill, learning, torchrun.

Most cases call the CLI in this process (`train_here`): a bad input, `--cfg job`, a sweep and the learning run
prove the same there as in a child process, without its start-up. A child process runs where the process is the
thing under test: the console script's exit code and stderr, kill -9 and resume, torchrun's ranks."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch

from conftest import composed, longstraw, rows, torchrun
from longstraw_cli.cli import check_overrides
from longstraw_cli.config import ConfigError

SMALL = ["prompt_tokens=256", "response_tokens=8", "group_size=4", "logger.backends=[jsonl]"]
DETERMINISTIC = ("reward_mean", "reward_std", "loss", "pg_loss", "grad_norm", "entropy", "num_tokens", "clip_frac")


@pytest.mark.parametrize("override, expected", [
    ("model=qwen99", "model=qwen99: no such model config; valid: ['glm52', 'glm52_mini', 'glm52_tiny', 'qwen36', "
         "'qwen36_mini', 'qwen36_tiny']"),
    ("foo=1", "unknown config key 'foo'; valid keys at the top level"),
    ("optim.lrr=3", "unknown config key 'optim.lrr' (did you mean 'optim.lr'?); valid keys under 'optim': ['betas', "
                    "'lr'"),
    ("algo=ppo", "algo=ppo: no such algo config; valid: ['dapo', 'dr_grpo', 'grpo', 'gspo', 'sft']"),
    ("strategy=zero3", "strategy=zero3: no such strategy config; valid: ['ddp', 'deepspeed', 'fsdp2']"),
    ("strategy.zero_stage=1", "unknown config key 'strategy.zero_stage' for strategy=ddp (it is a key of "
                              "strategy=deepspeed); valid keys under 'strategy': ['name']"),
    # a key of another option of the group, a close name, a key of a section the chosen option lacks
    ("task.path=x", "unknown config key 'task.path' for task=char_choice (it is a key of task=dataset, task=jsonl); "
                    "valid keys under 'task': ['alphabet', "),
    ("rollout.native.cuda_grap=x", "(did you mean 'rollout.native.cuda_graph'?); valid keys under 'rollout.native'"),
    ("logger.wandb.project=p", "unknown config key 'logger.wandb.project' for logger=console (it is a key of "
                               "logger=wandb); valid keys under 'logger': ['backends', "),
    # a comma list without -m: Hydra's six lines of "Ambiguous value"
    ("optim.lr=1e-3,3e-3", "optim.lr=1e-3,3e-3 is a sweep (a comma list), which `longstraw train -m` runs as one job "
                           "per value; give one value"),
    ("logger.backends=console,jsonl", "give one value, or a list in brackets (logger.backends=[console,jsonl])"),
    ("model=qwen36_tiny,glm52_tiny", "is a sweep (a comma list), which `longstraw train -m` runs as one job per "
                                     "value; give one value"),
])
def test_bad_keys_and_group_options_are_caught_before_hydra(override, expected):
    problem = check_overrides([override])
    assert expected in problem
    # the bracket form is offered where the key takes a list, and only there
    assert ("brackets" in problem) == (override == "logger.backends=console,jsonl"), problem
    assert check_overrides(["model=qwen36_tiny", "group_size=3", "optim.lr=0.1", "hydra.run.dir=x"]) is None
    # sweeps are checked value by value
    assert "model=nope" in check_overrides(["model=qwen36_tiny,nope"], multirun=True)
    assert check_overrides(["optim.lr=1e-3,3e-3", "task=jsonl", "task.path=x"], multirun=True) is None


@pytest.mark.parametrize("args, expected", [
    (["group_size=1"], "group_size must be an integer >= 2, got 1"),
    (["cp=2"], "cp=2 does not divide the world size 1; valid: [1]"),
    (["ep=2"], "ep=2 does not divide the world size 1; valid: [1]"),
    (["prompt_tokens=70000"], "exceeds the model's 65536 positions"),
    (["model=qwen36_tiny", "foo=1"], "unknown config key 'foo'"),
    (["task=jsonl"], "missing value(s) for ['task.path']"),
    (["algo.kl_estimator=k9"], "unknown kl_estimator 'k9'; valid choices: ['k1', 'k2', 'k3']"),
    (["strategy.name=zero"], "strategy: name='zero'; valid: ['ddp', 'fsdp2', 'deepspeed']"),
    (["strategy=deepspeed", "strategy.zero_stage=3"], "strategy: zero_stage=3; valid: [1, 2]"),
    (["capture.gradient=full"], "capture: gradient='full'; valid: ['response_only', 'exact']"),
    (["capture.walk_checkpoint=yes"], "capture.walk_checkpoint='yes' must be true or false"),
    (["lora.quantize=nf4"], "lora.quantize=nf4 freezes a quantised base and trains adapters: it needs lora.rank > 0"),
    (["lora.rank=4", "lora.quantize=int4"], "lora.quantize='int4'; valid: ['none', 'nf4']"),
    (["lora.rank=4", "lora.quantize=nf4", "model.dtype=float16"],
     "lora.quantize=nf4 computes in model.dtype, which must be one of ['bfloat16', 'float32', 'float64']"),
    (["lora.rank=4", "rollout.native.nf4_cache=true"],
     "rollout.native.nf4_cache=true caches dequantised NF4 weights: needs lora.quantize=nf4, got lora.quantize=none"),
    (["rollout.native.nf4_cache=maybe"], "rollout.native.nf4_cache='maybe' must be true or false or auto"),
    (["rollout.native.offload_copy_gib=0"],
     "rollout.native.offload_copy_gib=0 caps the copies of offloaded pages: needs capture.offload=cpu"),
    (["capture.offload=cpu", "rollout.native.offload_copy_gib=-1"],
     "offload_copy_gib must be auto or a number of GiB >= 0, got -1"),
    (["model.override_config={num_layers:2}"], "model.override_config={'num_layers': 2}: unknown model override(s) "
                                               "['num_layers']; valid: ['full_attention_interval', 'head_dim', "),
    (["model.override_config={num_hidden_layers:two}"], "model.override_config.num_hidden_layers='two' must be an "
                                                        "integer"),
    (["model.override_config={num_hidden_layers:0}"], "num_hidden_layers=0 must be >= 1"),
    (["model.override_config=3"], "model.override_config=3 must be a mapping of config fields"),
    (["model=glm52_tiny", "model.override_config={num_experts_per_tok:9}"], "num_experts_per_tok=9 does not fit"),
    # a synthetic task's fixed text is checked at start, not at step 0
    (["task=passkey", "prompt_tokens=10"], "task 'passkey': prompt_tokens=10 is too small; its fixed text alone is"),
    (["logger.samples=-1"], "logger.samples=-1; valid: an integer >= 0"),
    (["logger.samples=all"], "logger.samples='all'; valid: an integer >= 0"),
])
def test_bad_input_exits_2_with_one_line(train_here, tmp_path, args, expected):
    code, _, err = train_here([*args, f"run_dir={tmp_path / 'run'}"])
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], err
    # refused before anything was written: no run dir (.hydra/, an empty log) is left behind
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, expected", [
    (["optim.lr=1e-3,3e-3"], "optim.lr=1e-3,3e-3 is a sweep (a comma list)"),
    (["run_dir=/proc/no/such/dir"], "run_dir='/proc/no/such/dir' cannot be made: No such file or directory"),
    (["run_dir=/dev/null/run"], "run_dir='/dev/null/run' cannot be made: Not a directory"),
    (["task.path=x"], "unknown config key 'task.path' for task=char_choice (it is a key of task=dataset, task=jsonl)"),
    (["group_size=1"], "group_size must be an integer >= 2, got 1"),
])
def test_a_refused_launch_says_one_line_and_leaves_no_run_dir(train_here, tmp_path, args, expected):
    """Without run_dir the run dir would be runs/<run id>: nothing of it is made before the config's checks pass."""
    code, _, err = train_here(args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expected in lines[0], err
    assert list(tmp_path.iterdir()) == []


def test_hydra_info_makes_no_run_dir(train_here, tmp_path):
    """--info (and the other Hydra flags that run no job) print and leave nothing behind."""
    code, out, _ = train_here(["--info", "config"])
    assert code == 0 and "Config" in out
    assert list(tmp_path.iterdir()) == []
    # it uses no run dir, so a run_dir that could not be one does not refuse it
    (tmp_path / "f").write_text("")
    code, out, _ = train_here(["--info", "config", "run_dir=f"])
    assert code == 0 and "Config" in out


def test_a_value_that_reads_hydras_config_resolves_as_in_the_job(tmp_path):
    """`${hydra:runtime.output_dir}` names the job's run dir, in the checks before Hydra starts as in the job (a
    process of its own: in this one an earlier test's Hydra config would answer)."""
    # the caches' own variables, which an earlier test of this process may have set, would win over the setting
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-m", "longstraw_cli", "train", "steps=1", "group_size=2",
                          "prompt_tokens=64", "response_tokens=4", "checkpoint.enabled=false",
                          f"run_dir={tmp_path / 'run'}", "compile_cache_dir=${hydra:runtime.output_dir}/cc"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "run" / "cc" / "triton").is_dir(), out.stderr


def test_console_script_exits_2_with_one_line_and_no_traceback(tmp_path):
    script = Path(sys.executable).with_name("longstraw")
    if not script.exists():
        pytest.skip(f"the console script is not installed beside {sys.executable}")
    out = subprocess.run([str(script), "train", "group_size=1", f"run_dir={tmp_path / 'run'}"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "group_size must be an integer >= 2, got 1" in lines[0], out.stderr


def test_hydra_full_error_raises_instead_of_one_line(train_here, tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigError, match="group_size must be an integer >= 2, got 1"):
        train_here(["group_size=1", f"run_dir={tmp_path / 'run'}"])


def test_bad_jsonl_row_names_file_and_line(train_here, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "p", "answer": "a"}\n{"prompt": "p"}\n')
    code, _, err = train_here(["task=jsonl", f"task.path={data}", f"run_dir={tmp_path / 'run'}"])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{data}:2" in err
    # refused at set-up, after Hydra made the run dir: it goes again (it held .hydra/ and a log of that line)
    assert not (tmp_path / "run").exists()
    (tmp_path / "kept").mkdir()
    code, _, err = train_here(["task=jsonl", f"task.path={data}", f"run_dir={tmp_path / 'kept'}"])
    assert code == 2 and (tmp_path / "kept" / "train_rank0.log").exists()


def test_cfg_job_prints_and_does_not_run(train_here, tmp_path):
    code, out, _ = train_here(["--cfg", "job", "group_size=3"])
    assert code == 0
    assert "group_size: 3" in out and not (tmp_path / "runs").exists()


def test_multirun_sweep_runs_each_job(train_here, tmp_path):
    code, _, err = train_here(["-m", "group_size=2,3", "steps=1", *SMALL[:2], "logger.backends=[jsonl]",
                               f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert code == 0, err
    for job, g in (("0", 2), ("1", 3)):
        [row] = rows(tmp_path / "sweep" / job)
        assert row["num_tokens"] <= 8 * g
        assert f"run dir {tmp_path / 'sweep' / job} (sweep job {job} in {tmp_path / 'sweep'})" in err


def test_console_says_where_the_run_went(train_here, tmp_path):
    """One line each: the run dir, what resume=auto found, every checkpoint written, the export, the end."""
    run = tmp_path / "run"
    code, _, err = train_here([*SMALL, "steps=1", "resume=auto", f"run_dir={run}"])
    assert code == 0, err
    ckpt = run / "checkpoints"
    assert f"longstraw: resume=auto: {ckpt} holds no checkpoint yet; starting at step 0" in err
    assert f"longstraw: run dir {run}\n" in err
    assert f"longstraw: checkpoint {ckpt / 'step_00000001'} written (after step 0)" in err
    assert f"longstraw: finished 1 step in {run}; last checkpoint {ckpt / 'step_00000001'}" in err
    code, _, err = train_here([*SMALL, "steps=2", "resume=true", "export_hf=true", f"run_dir={run}"])
    assert code == 0, err
    assert f"longstraw: resumed from {ckpt / 'step_00000001'} at step 1 of 2" in err
    assert f"longstraw: exported {run / 'hf'}" in err


def test_resume_without_a_run_dir_is_refused(train_here, tmp_path, monkeypatch):
    # a launch without run_dir gets a new directory: nothing to resume there (a slurm job id is kept on requeue)
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for value in ("true", "auto"):
        code, _, err = train_here([f"resume={value}"])
        assert code == 2 and len(err.strip().splitlines()) == 1
        assert f"resume={value} needs run_dir=" in err and not (tmp_path / "runs").exists()


def test_resume_true_of_a_run_dir_that_does_not_exist_is_refused(train_here, tmp_path, monkeypatch):
    """A typo in run_dir: one line, exit 2, no directory made. resume=auto starts a run there; a relaunch that keeps
    its run id (a requeued slurm job) may find its directory not made yet, and starts too."""
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    code, _, err = train_here([*SMALL, "steps=1", "resume=true", "run_dir=runs/typo"])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0] == ("longstraw: error: resume=true: run_dir='runs/typo' does not exist, so there is no run to "
                        "continue; resume=auto continues a run where there is one and starts one where there is none")
    assert not (tmp_path / "runs").exists()
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    code, _, err = train_here([*SMALL, "steps=1", "resume=true", "run_dir=runs/requeued"])
    assert code == 0 and "resume=true: " in err and "holds no checkpoint yet; starting at step 0" in err
    code, _, err = train_here([*SMALL, "steps=1", "resume=maybe", "run_dir=runs/x"])
    assert code == 2 and "resume='maybe' must be true or false or auto" in err


def test_train_config_is_typed_and_frozen():
    from longstraw_cli.config import train_config

    cfg = composed(["algo=dapo", "lora.rank=4", "group_size=6", "run_dir=x"])
    tc = train_config(cfg)
    assert tc.loss.name == "dapo" and tc.loss.clip_high == 0.28 and tc.lora.rank == 4 and tc.group_size == 6
    assert tc.rollout.sampling.max_new_tokens == tc.response_tokens
    with pytest.raises(dataclasses.FrozenInstanceError):
        tc.group_size = 3
    with pytest.raises(ConfigError, match="cp=3 does not divide the world size 4; valid: \\[1, 2, 4\\]"):
        train_config({**cfg, "cp": 3}, world_size=4)


def test_glm52_exports_and_takes_vllm_but_not_vllm_under_expert_parallel():
    from longstraw_cli.config import train_config

    assert train_config(composed(["model=glm52_tiny", "export_hf=true", "run_dir=x"])).export_hf
    cfg = composed(["model=glm52_tiny", "rollout=vllm", "run_dir=x"])
    assert train_config(cfg).rollout.engine == "vllm"
    assert train_config({**cfg, "cp": 2, "export_hf": True}, world_size=2).export_hf
    with pytest.raises(ConfigError, match="rollout=vllm loads every routed expert into each rank's engine, but ep=2"):
        train_config({**cfg, "cp": 2, "ep": 2}, world_size=2)


@pytest.mark.parametrize("model", ["qwen36", "glm52"])
def test_named_configs_admit_the_papers_longest_prompt(model):
    """The paper's 4,456,448-position point with 1K responses fits the named configs' 8M positions; past them is
    refused in one line."""
    from longstraw_cli.config import train_config

    cfg = composed([f"model={model}", "cp=8", "prompt_tokens=4456448", "response_tokens=1024", "run_dir=x"])
    assert train_config(cfg, world_size=8).prompt_tokens == 4_456_448
    with pytest.raises(ConfigError, match="8388608 positions"):
        train_config({**cfg, "prompt_tokens": 2**23}, world_size=8)


def test_override_config_gives_the_named_shape_at_a_reduced_depth(train_here, tmp_path):
    """model.override_config replaces fields of a named shape (#18's glm52 at a reduced depth): the trainer
    builds it, with the shape's per-layer patterns repeated (tests/models/test_plan.py: `plan` plans it); a model.path
    is refused."""
    from longstraw_cli.config import train_config
    from longstraw_cli.models.glm52.config import NAMED_CONFIGS

    cfg = train_config(composed(["model=glm52", "model.override_config={num_hidden_layers:8}", "cp=8", "ep=8",
                                 "prompt_tokens=1048576", "run_dir=x"]), world_size=8)
    _, shape = cfg.model.family_config()
    full = NAMED_CONFIGS["glm52"]
    assert shape == dataclasses.replace(full, num_hidden_layers=8)
    cfg = train_config(composed(["model=glm52_mini", "model.override_config={num_hidden_layers:8}", "run_dir=x"]))
    assert cfg.model.family_config()[1].indexer_types == NAMED_CONFIGS["glm52_mini"].indexer_types[:8]
    run = tmp_path / "run"
    code, _, err = train_here(["model=glm52_tiny", "model.override_config={num_hidden_layers:2,n_routed_experts:4}",
                               "steps=1", "prompt_tokens=64", "response_tokens=4", "group_size=2",
                               "logger.backends=[jsonl]", f"run_dir={run}"])
    assert code == 0, err
    weights = safetensors.torch.load_file(run / "checkpoints" / "step_00000001" / "model.safetensors")
    assert {int(n.split(".")[2]) for n in weights if n.startswith("model.layers.")} == {0, 1}
    assert weights["model.layers.1.mlp.experts.gate_up_proj"].shape[0] == 4
    code, _, err = train_here(["model.override_config={num_hidden_layers:2}", f"model.path={tmp_path}",
                               f"run_dir={tmp_path / 'other'}"])
    assert code == 2 and "model.override_config replaces fields of a named shape" in err, err


def test_exact_gradient_refuses_what_it_does_not_run_with():
    from longstraw_cli.config import train_config

    cfg = composed(["capture.gradient=exact", "run_dir=x"])
    assert train_config(cfg).transaction.exact
    # context parallel runs it, whatever the strategy's name (one data-parallel rank: nothing to reduce)
    assert train_config({**cfg, "cp": 2, "strategy": {"name": "fsdp2"}}, world_size=2).cp == 2
    with pytest.raises(ConfigError, match="strategy=ddp only with data parallelism; got strategy='fsdp2'"):
        train_config({**cfg, "cp": 2, "strategy": {"name": "fsdp2"}}, world_size=4)
    with pytest.raises(ConfigError, match="strategy=ddp only with data parallelism; got strategy='fsdp2'"):
        train_config({**cfg, "strategy": {"name": "fsdp2"}}, world_size=2)
    with pytest.raises(ConfigError, match="needs lora.dropout=0, got lora.dropout=0.1"):
        train_config({**cfg, "lora": {**cfg["lora"], "rank": 4, "dropout": 0.1}})


def test_exact_gradient_train_runs_the_prompt_walk(train_here, tmp_path):
    # walk_checkpoint: the model-level tests cover the walk without it
    code, _, err = train_here(["steps=2", *SMALL, "capture.gradient=exact", "capture.block_size=100",
                               "capture.walk_checkpoint=true", f"run_dir={tmp_path / 'run'}"])
    assert code == 0, err
    for row in rows(tmp_path / "run"):
        assert row["time/prompt"] > 0 and row["mem/state_grad"] > 0


@pytest.mark.slow
def test_resume_after_kill_continues_with_uninterrupted_metrics(train_here, tmp_path):
    # a checkpoint every step; killed once the third is written, with steps still to run
    common = [*SMALL, "steps=6", "checkpoint.every=1"]
    full = longstraw([*common, f"run_dir={tmp_path / 'full'}"], cwd=tmp_path)
    assert full.returncode == 0, full.stderr

    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "longstraw_cli", "train", *common, f"run_dir={run}"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    def newest_checkpoint() -> int:
        # a checkpoint being written holds its COMPLETE in step_N.tmp-<pid>/ until the rename: not one yet
        steps = [int(p.parent.name[len("step_"):]) for p in (run / "checkpoints").glob("step_*/COMPLETE")
                 if ".tmp-" not in p.parent.name]
        return max(steps, default=0)

    deadline = time.time() + 600
    while time.time() < deadline and newest_checkpoint() < 3 and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed: the test would prove nothing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len(rows(run))
    assert killed_at < 6

    code, _, err = train_here([*common, f"run_dir={run}"])
    assert code == 2 and "resume=true" in err
    resumed = longstraw([*common, f"run_dir={run}", "resume=true"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    got, want = rows(run), rows(tmp_path / "full")
    assert [r["step"] for r in got] == list(range(6))
    for a, b in zip(got, want):
        assert {k: a[k] for k in DETERMINISTIC} == {k: b[k] for k in DETERMINISTIC}


def reward_ends(run_dir, n: int = 4) -> tuple[float, float]:
    """The mean reward of a run's first n steps and of its last n (printed: the learning curve's two ends)."""
    reward = [r["reward_mean"] for r in rows(run_dir)]
    first, last = sum(reward[:n]) / n, sum(reward[-n:]) / n
    print(f"{run_dir.name}: mean reward first {n} steps {first:.3f}, last {n} steps {last:.3f}")
    return first, last


@pytest.mark.slow
def test_learning_raises_mean_reward(train_here, tmp_path):
    code, _, err = train_here(["steps=20", "prompt_tokens=256", "logger.backends=[jsonl]",
                               f"run_dir={tmp_path / 'run'}"])
    assert code == 0, err
    first, last = reward_ends(tmp_path / "run")
    assert first < 0.05 and last > 0.5
    assert (tmp_path / "run" / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen36_tiny", "glm52_tiny"])
def test_qlora_trains_adapters_and_resumes_exactly(train_here, tmp_path, model):
    """lora.quantize=nf4 end to end: steps have gradients (a dense reward: ASCII characters in the response),
    the checkpoints hold adapters only, and a run stopped at step 4 and resumed logs the uninterrupted run's steps
    (its NF4 base rebuilt from the seed, quantised again). That the reward rises: the test below."""
    common = [f"model={model}", *SMALL, "checkpoint.every=4", "lora.rank=8", "lora.quantize=nf4", "optim.lr=0.05",
              "task.reward=rewards_for_tests:ascii_count"]
    code, _, err = train_here([*common, "steps=8", f"run_dir={tmp_path / 'full'}"])
    assert code == 0, err
    code, _, err = train_here([*common, "steps=4", f"run_dir={tmp_path / 'part'}"])
    assert code == 0, err
    code, _, err = train_here([*common, "steps=8", "resume=true", f"run_dir={tmp_path / 'part'}"])
    assert code == 0, err
    full, resumed = rows(tmp_path / "full"), rows(tmp_path / "part")
    assert [r["step"] for r in resumed] == list(range(8))
    for a, b in zip(resumed, full):
        assert {k: a[k] for k in DETERMINISTIC} == {k: b[k] for k in DETERMINISTIC}
    # a group whose rewards tie has no advantage, so no gradient: most steps have one
    assert sum(r["grad_norm"] > 0 for r in full) >= 6
    from safetensors import safe_open

    with safe_open(str(tmp_path / "full" / "checkpoints" / "step_00000008" / "model.safetensors"), "pt") as f:
        assert f.keys() and all(".lora_" in k for k in f.keys())
    # a QLoRA checkpoint does not resume as LoRA on an unquantised base
    code, _, err = train_here([*common[:-3], "lora.quantize=none", "optim.lr=0.05",
                               "task.reward=rewards_for_tests:ascii_count", "steps=9", "resume=true",
                               f"run_dir={tmp_path / 'part'}"])
    assert code == 2 and "lora.quantize changed from 'nf4' to 'none'" in err


def test_checkpoint_enabled_false_writes_none(train_here, tmp_path):
    code, _, err = train_here([*SMALL, "steps=2", "checkpoint.every=1", "checkpoint.enabled=false",
                               f"run_dir={tmp_path / 'run'}"])
    assert code == 0, err
    assert len(rows(tmp_path / "run")) == 2
    assert not any((tmp_path / "run" / "checkpoints").glob("step_*"))
    code, _, err = train_here([*SMALL, "checkpoint.enabled=maybe", f"run_dir={tmp_path / 'bad'}"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "checkpoint.enabled='maybe'" in err, err


@pytest.mark.slow
def test_qlora_learns_on_a_trained_base(train_here, tmp_path):
    """QLoRA's learning curve. Adapters cannot move a random tiny model: its frozen lm_head is so small that no
    hidden state changes the logits' entropy from ln(259) (measured: 5.54 over 40 steps at any lr, LoRA or
    QLoRA). So a base is trained first (full fine-tuning, 12 steps, towards non-ASCII bytes) and exported; QLoRA
    r16 on that base, loaded and quantised layer by layer from model.path, is then rewarded for ASCII bytes."""
    code, _, err = train_here(["steps=12", "task.reward=rewards_for_tests:non_ascii_share", "export_hf=true",
                               "checkpoint.every=0", "logger.backends=[jsonl]", f"run_dir={tmp_path / 'base'}"])
    assert code == 0, err
    code, _, err = train_here([f"model.path={tmp_path / 'base' / 'hf'}", "lora.rank=16", "lora.quantize=nf4",
                               "optim.lr=0.01", "steps=12", "task.reward=rewards_for_tests:ascii_share",
                               "checkpoint.enabled=false", "logger.backends=[jsonl]",
                               f"run_dir={tmp_path / 'qlora'}"])
    assert code == 0, err
    first, last = reward_ends(tmp_path / "qlora")
    assert first < 0.45 and last > 0.6


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_torchrun_ranks_share_one_run_dir(tmp_path, strategy):
    """Also fsdp2's checkpoint under torchrun (deepspeed's: tests/distributed/test_strategy.py), on this launch."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "longstraw_cli", "train", *SMALL, "steps=2", f"strategy={strategy}"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    [run] = list((tmp_path / "runs").iterdir())
    assert (run / ".hydra" / "config.yaml").exists()
    log = (run / "train_rank1.log").read_text()
    assert (run / "train_rank0.log").exists() and f"strategy {strategy}" in log and "rank 1 step 0 " in log
    assert [r["step"] for r in rows(run)] == [0, 1]
    # rank 0 names the run dir once; no rank warns (FSDP2 about a view it was handed, DDP about searching for
    # unused parameters where the trainable set has none)
    assert out.stderr.count(f"longstraw: run dir {run}") == 1, out.stderr
    assert "Warning" not in out.stderr and "find_unused_parameters" not in out.stderr, out.stderr
    checkpoint = run / "checkpoints" / "step_00000002"
    assert (checkpoint / "COMPLETE").exists()
    if strategy == "fsdp2":
        # sharded: each rank wrote its own file, no whole-tensor file; one process resumes from it
        assert len(list((checkpoint / "dcp").glob("*.distcp"))) == 2 and not (checkpoint / "model.safetensors").exists()
        resumed = longstraw([*SMALL, "steps=3", f"strategy={strategy}", "resume=true", f"run_dir={run}"], cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "rank 0 of 1 (" in (run / "train_rank0.log").read_text()
        assert (run / "checkpoints" / "step_00000003" / "COMPLETE").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_data_parallel_ranks_merge_their_rewards_extra_figures(tmp_path):
    """Two data-parallel ranks whose rewards give different keys at one step (passkey's examples 0 and 1):
    `reward/<key>` is each key's mean over the responses that gave it, on either rank."""
    out = torchrun(["task=passkey", "prompt_tokens=256", "response_tokens=4", "group_size=2", "steps=2",
                    "logger.backends=[jsonl]", "task.reward=rewards_for_tests:verl_extras",
                    f"run_dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = rows(tmp_path / "run")
    assert first["reward/parity_0"] == first["reward/parity_1"] == 1.0
    for row in (first, second):
        assert 0 <= row["reward/chars"] <= 4 * 4 and row["reward_mean"] == pytest.approx(row["reward/chars"] / 10)


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_bad_input_is_one_line_for_the_launch(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "longstraw_cli", "train", *SMALL, "cp=3"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode != 0
    line = "longstraw: error: cp=3 does not divide the world size 2; valid: [1, 2]"
    # printed by rank 0 alone, and named in torchrun's failure summary (the workers' error file). Counted as text,
    # not as whole lines: two ranks and torchrun write one stderr, and under load another process's output can
    # land at the start of the line
    summary = out.stderr.count(f"traceback : {line}")
    assert summary >= 1 and out.stderr.count(line) - summary == 1, out.stderr


def test_lora_with_kl_reference_trains_adapters_only_and_exports_hf(train_here, tmp_path):
    run = tmp_path / "run"
    code, _, err = train_here([*SMALL, "steps=2", "lora.rank=4", "algo.kl_coef=0.05", "export_hf=true",
                               f"run_dir={run}"])
    assert code == 0, err
    first, second = rows(run)
    # fresh adapters are a no-op: the policy is the reference, so the KL starts at exactly zero
    assert first["kl_mean"] == 0.0 and second["kl_mean"] > 0
    from safetensors import safe_open

    with safe_open(str(run / "checkpoints" / "step_00000002" / "model.safetensors"), "pt") as f:
        assert f.keys() and all(".lora_" in k for k in f.keys())
    from longstraw_cli.models import from_pretrained

    merged = from_pretrained(run / "hf")
    assert not any("lora" in n for n, _ in merged.named_parameters())


# name -> (model, what splits it over two ranks, the mode under test)
CP2_CASES = {
    # blocks of 64: two capture blocks a shard (tests/e2e/test_offload_cli.py stages them under capture.offload=cpu)
    "qwen36": ("qwen36_tiny", ["cp=2"], ["capture.block_size=64"]),
    "glm52_ep2": ("glm52_tiny", ["cp=2", "ep=2"], []),
    # 255 captured tokens in shards of 128 and 127: the block [100, 200) straddles them
    "qwen36_exact": ("qwen36_tiny", ["cp=2"], ["capture.gradient=exact", "capture.block_size=100"]),
    # QLoRA: NF4 base linears on every rank (each quantises the same weights), adapters trained
    "qwen36_qlora": ("qwen36_tiny", ["cp=2"], ["lora.rank=4", "lora.quantize=nf4"]),
    "glm52_ep2_qlora": ("glm52_tiny", ["cp=2", "ep=2"], ["lora.rank=4", "lora.quantize=nf4"]),
    # capture reuse: step 1 trains on step 0's capture, its drift probe re-captures the tail across the shards
    "qwen36_lora_reuse": ("qwen36_tiny", ["cp=2"], ["capture.reuse_steps=2", "lora.rank=4", "capture.probe_tokens=40"]),
    # ... and step 2 captures again; a KL reference, itself split over the ranks
    "glm52_ep2_reuse": ("glm52_tiny", ["cp=2", "ep=2"], ["capture.reuse_steps=2", "algo.kl_coef=0.1", "steps=3"]),
    # responses without a decode (docs/guide/offline.md): algo=sft on synthetic ones, the exact gradient
    "glm52_ep2_sft": ("glm52_tiny", ["cp=2", "ep=2"], ["rollout=synthetic", "algo=sft", "capture.gradient=exact"]),
}


def cp2_case(name: str) -> tuple[list[str], list[str]]:
    """-> (the one-rank run's arguments, the two-rank run's) of a CP2_CASES case."""
    model, parallel, mode = CP2_CASES[name]
    args = [f"model={model}", "steps=2", "prompt_tokens=256", "response_tokens=8", "group_size=4",
            "model.dtype=float64", "logger.backends=[jsonl]", *mode]
    return args, [*args, *parallel]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CP2_CASES))
def test_cp2_train_step_matches_cp1(train_here, torchrun_once, tmp_path, name):
    """Two ranks sharing each prompt (glm52: also splitting the experts) train as one rank does, exact mode's
    gradient through the prompt and capture reuse's drift included. The two-rank launch is shared with
    tests/e2e/test_offload_cli.py's comparisons (`torchrun_once`)."""
    args, cp2_args = cp2_case(name)
    mode = CP2_CASES[name][2]
    code, _, err = train_here([*args, f"run_dir={tmp_path / 'cp1'}"])
    assert code == 0, err
    cp1, cp2 = rows(tmp_path / "cp1"), rows(torchrun_once(cp2_args))
    assert len(cp2) == len(cp1) == (3 if "steps=3" in mode else 2)
    for a, b in zip(cp2, cp1):
        assert abs(a["loss"] - b["loss"]) <= 1e-9 * max(1.0, abs(b["loss"]))
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-9 * max(1.0, b["grad_norm"])
        assert a["reward_mean"] == b["reward_mean"]
        assert a["mem/resident"] < b["mem/resident"]
        assert ("time/prompt" in a) == ("capture.gradient=exact" in mode)
        if "capture.reuse_steps=2" in mode:
            assert a["captures"] == b["captures"] and abs(a["drift"] - b["drift"]) <= 1e-9 * max(1.0, b["drift"])
    assert cp1[0]["grad_norm"] > 0
    if "capture.reuse_steps=2" in mode:
        # a capture every second step
        assert [r["captures"] for r in cp2] == [1 - step % 2 for step in range(len(cp2))] and cp2[1]["drift"] > 0
    # metrics.jsonl has the worst rank's times and memory; each rank's log has its own (the shards differ in size)
    own = [rank_rows(torchrun_once(cp2_args) / f"train_rank{rank}.log") for rank in (0, 1)]
    for step, row in enumerate(cp2):
        for key in own[0][step]:
            if key.startswith(("time/", "mem/")):
                assert row[key] == max(own[0][step][key], own[1][step][key]), key
            else:
                # the ranks of one context-parallel group compute the same numbers: rank 0's are logged
                assert row[key] == own[0][step][key] == own[1][step][key], key
    assert own[0][0]["mem/resident"] != own[1][0]["mem/resident"]


def rank_rows(log: Path) -> list[dict]:
    """The metrics a rank logged in its train_rank*.log, one dict per step."""
    found = (re.search(r"rank \d+ step \d+ (\{.*\})$", line) for line in log.read_text().splitlines())
    return [json.loads(m.group(1)) for m in found if m]


@pytest.mark.slow
@pytest.mark.distributed
def test_expert_parallel_checkpoint_resumes_exactly_under_any_ep(glm52_ep_runs):
    """ep=2 checkpoints are sharded (each rank writes its experts and their AdamW moments at their global rows): a
    run stopped after step 2 and resumed with ep=2 or ep=1 (every expert read into one rank) logs the steps of an
    uninterrupted ep=2 run (the runs: conftest's glm52_ep_runs). The KL term (against a frozen
    reference, itself expert parallel) and a reward that varies within each group make every step's gradient
    large enough that restoring the experts' AdamW moments wrongly shows (checked by hand: zeroing them moves
    the resumed steps' grad norms by far more than the tolerance)."""
    runs, _ = glm52_ep_runs
    saved = runs / "ep2" / "checkpoints" / "step_00000002" / "dcp"
    assert sorted(f.name for f in saved.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    whole = rows(runs / "whole")
    # moments are nonzero at the step-2 checkpoint, and the resumed steps train
    assert len(whole) == 4 and all(r["grad_norm"] > 0.1 for r in whole[1:])
    for resumed in (rows(runs / "ep2"), rows(runs / "ep1")):
        assert len(resumed) == 4
        for a, b in zip(resumed, whole):
            assert abs(a["loss"] - b["loss"]) <= 1e-9 * max(1.0, abs(b["loss"]))
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-9 * max(1.0, b["grad_norm"])
