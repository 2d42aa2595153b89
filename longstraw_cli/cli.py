"""`longstraw train [overrides]` and `longstraw plan [overrides]`: Hydra at the edge.

Overrides are checked before Hydra composes (unknown keys, bad group options, a comma list without -m: one line
naming the bad value and the valid choices). A single job's config is then composed and checked as a TrainConfig
before Hydra writes anything, so a refused launch leaves no run dir behind; the run dir is made here, then Hydra
composes the same config, which becomes the TrainConfig the Trainer sees, and nothing else.
`-m` sweeps, `--cfg job`, `--help` and `hydra.*` overrides are Hydra's own. Under torchrun every rank runs
Hydra with one shared run dir; rank 0 alone writes `.hydra/`, and every rank logs to `train_rank{RANK}.log`.
Set HYDRA_FULL_ERROR=1 for tracebacks. A run that stops early ends with one line and the exit status safety/errors.py
lists; `longstraw train` holds run_dir's lock (safety/runlock.py) while it trains.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import json
import logging
import os
import re
import secrets
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path

from hydra.types import RunMode
from omegaconf import OmegaConf

# the Hydra configs ship inside the package, so an installed wheel runs from any directory
CONF_DIR = Path(__file__).resolve().parent / "conf"
GROUPS = ("model", "task", "algo", "rollout", "logger", "strategy")


@functools.cache
def _run_id() -> str:
    """This launch's run id, drawn once (`train` clears it for the next launch in this process): the run dir checked
    and made before Hydra starts is the one Hydra then uses."""
    return _draw_run_id()


def _draw_run_id() -> str:
    """One id shared by all ranks of a launch: torchrun's rendezvous id (unique with --standalone), else the
    slurm job, else the master endpoint under torchrun, else the local time and a random suffix (two launches in
    one second get two ids)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id and run_id != "none":
        return run_id
    if "SLURM_JOB_ID" in os.environ:
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    if "WORLD_SIZE" in os.environ:
        return f"torchrun-{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}"
    return f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def _run_id_is_stable() -> bool:
    """Whether a relaunch gets this launch's run id (a requeued slurm job, torchrun with its own --rdzv-id), not
    a fresh one (the local time and a random suffix, `torchrun --standalone`'s random uuid)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id and run_id != "none":
        return re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", run_id) is None
    return "SLURM_JOB_ID" in os.environ


def _hydra_subdir() -> str | None:
    return ".hydra" if os.environ.get("RANK", "0") == "0" else None


def _run_dir(run_dir: str | None) -> str:
    """Hydra's run dir: run_dir, expanded as config.py expands it (Hydra writes .hydra/ and the log there first)."""
    from longstraw_cli.config import expand_path

    return expand_path(run_dir, "run_dir") if run_dir else f"runs/{_run_id()}"


OmegaConf.register_new_resolver("longstraw_run_id", _run_id, replace=True, use_cache=True)
OmegaConf.register_new_resolver("longstraw_run_dir", _run_dir, replace=True)
OmegaConf.register_new_resolver("longstraw_hydra_subdir", _hydra_subdir, replace=True)


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_overrides(overrides: list[str], *, multirun: bool = False, own_keys: tuple[str, ...] = ()) -> str | None:
    """The first problem with the command-line overrides as one line, or None. A comma list is a sweep, which only
    `-m` (multirun) runs; `own_keys`: a command's top-level keys beside the training config's (`longstraw plan`'s)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        return f"cannot parse overrides {overrides}: {str(e).splitlines()[0]}"
    chosen, sweep = {}, None
    for o in parsed:
        key = o.key_or_group
        if o.is_sweep_override() and not multirun and not key.startswith("hydra"):
            sweep = sweep or o
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        if key in GROUPS:
            for v in values:
                if v not in group_options(key):
                    return f"{key}={v}: no such {key} config; valid: {group_options(key)}"
            chosen[key] = values[0]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"{k}={v}" for k, v in chosen.items()])
    if sweep is not None:
        key = sweep.key_or_group
        # the bracket form only where the key takes a list (logger.backends, optim.betas)
        as_list = (f", or a list in brackets ({key}=[{sweep.get_value_string()}])"
                   if key not in GROUPS and OmegaConf.is_list(OmegaConf.select(cfg, key)) else "")
        return (f"{sweep.input_line} is a sweep (a comma list), which `longstraw train -m` runs as one job per "
                f"value; give one value{as_list}")
    for o in parsed:
        key = o.key_or_group
        if key in GROUPS or key.startswith("hydra.") or key == "hydra" or o.is_add() or o.is_delete():
            continue
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        # keys(), not `in`: a mandatory value (???) is "not in" a DictConfig but is a valid key to set
        if not OmegaConf.is_dict(node) or leaf not in node.keys():
            return _unknown_key(key, cfg, chosen, own_keys)
    return None


def _unknown_key(key: str, cfg, chosen: dict[str, str], own_keys: tuple[str, ...]) -> str:
    """One line for a key the composed config lacks: the other options of its group that have it (`task.path` is
    task=jsonl's and task=dataset's, not char_choice's), a close name, and the valid keys of the nearest section
    that exists."""
    parent = key.rpartition(".")[0]
    while parent and not OmegaConf.is_dict(OmegaConf.select(cfg, parent)):
        parent = parent.rpartition(".")[0]
    node = OmegaConf.select(cfg, parent) if parent else cfg
    valid = sorted({str(k) for k in node.keys() if k != "hydra"} | (set() if parent else set(own_keys)))
    line = f"unknown config key {key!r}"
    group, _, subkey = key.partition(".")
    if group in GROUPS:
        choice = chosen.get(group) or _default_option(group)
        others = [f"{group}={option}" for option in group_options(group)
                  if option != choice and _option_has(group, option, subkey)]
        line += f" for {group}={choice}" + (f" (it is a key of {', '.join(others)})" if others else "")
    close = difflib.get_close_matches(key[len(parent) + 1 if parent else 0:], valid, n=1)
    if close:
        line += f" (did you mean {(parent + '.' if parent else '') + close[0]!r}?)"
    return f"{line}; valid keys {f'under {parent!r}' if parent else 'at the top level'}: {valid}"


def _default_option(group: str) -> str:
    """The option config.yaml's defaults list chooses for `group`."""
    for entry in OmegaConf.load(CONF_DIR / "config.yaml").defaults:
        if OmegaConf.is_dict(entry) and group in entry:
            return str(entry[group])
    return "?"


def _option_has(group: str, option: str, subkey: str) -> bool:
    """Whether conf/<group>/<option>.yaml sets `subkey` (dotted)."""
    node = OmegaConf.load(CONF_DIR / group / f"{option}.yaml")
    parent, _, leaf = subkey.rpartition(".")
    node = OmegaConf.select(node, parent) if parent else node
    return OmegaConf.is_dict(node) and leaf in node.keys()


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _say_once(line: str, every_rank: bool) -> None:
    """A run's last line on stderr. Under torchrun, one the ranks meet alike (input refused at start, an agreed
    preemption) is printed by rank 0 alone, others by every rank with its number; every rank also leaves it in
    torchrun's error file, so torchrun's failure summary names it instead of pointing at its docs."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with contextlib.suppress(OSError):
            Path(error_file).write_text(json.dumps({"message": {"message": line, "extraInfo": {
                "py_callstack": line, "timestamp": str(int(time.time()))}}}))
    if every_rank and "WORLD_SIZE" in os.environ and os.environ["WORLD_SIZE"] != "1":
        line = line.replace("longstraw: ", f"longstraw: rank {_rank()}: ", 1)
    if every_rank or _rank() == 0:
        print(line, file=sys.stderr, flush=True)


def _fail(message: str, code: int = 2, kind: str = "error", *, every_rank: bool = False):
    _say_once(f"longstraw: {kind}: {message}", every_rank)
    sys.exit(code)


class BelowError(logging.Filter):
    """Lets warnings through to stderr, not errors: a run's last error is printed there once, by `_stop`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


def _stop(e: BaseException, *, every_rank: bool = True):
    """A run that stops early (errors.RunError): its line in the rank's log file and on stderr, its exit status.
    every_rank=False: an error every rank meets alike (set-up), printed once."""
    from longstraw_cli.safety.errors import RunError
    from longstraw_cli.safety.guard import NonFiniteStop
    from longstraw_cli.safety.preemption import Preempted

    code, kind = (e.exit_code, e.kind) if isinstance(e, RunError) else (2, "error")
    logging.getLogger("longstraw").error("%s", e)
    # the ranks agree on these (one all-reduce): one line for the launch
    every_rank = every_rank and not isinstance(e, (Preempted, NonFiniteStop))
    if getattr(e, "hard_exit", False):
        # a process group whose peer is gone may block its teardown: end here
        _say_once(f"longstraw: {kind}: {e}", every_rank)
        logging.shutdown()
        os._exit(code)
    _fail(str(e), code, kind, every_rank=every_rank)


def _override_value(overrides: list[str], name: str):
    """The value of the last `name=` override (the one Hydra takes) as Hydra's grammar reads it, or None."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    values = [o.value() for o in OverridesParser.create().parse_overrides(overrides)
              if o.key_or_group == name and not o.is_delete()]
    return values[-1] if values else None


def _run_dir_override(overrides: list[str]) -> str | None:
    """The value of the last `run_dir=` override (the one Hydra takes), expanded, if one is given."""
    from longstraw_cli.config import expand_path

    value = _override_value(overrides, "run_dir")
    return expand_path(value, "run_dir") if isinstance(value, str) and value else None


def _check_resume(overrides: list[str]) -> str | None:
    """Before Hydra makes a run dir: resume=true continues a run dir that exists, resume=auto continues one where
    there is one; both name it with run_dir. Not where a relaunch keeps its run id (a requeued slurm job, torchrun
    with its own --rdzv-id): its default directory, runs/<run id>, is the same at every launch, and the first finds
    none."""
    from longstraw_cli.config import ConfigError

    resume = _override_value(overrides, "resume")
    if not (resume is True or resume == "auto") or _run_id_is_stable():
        return None
    value = "true" if resume is True else "auto"
    try:
        run_dir = _run_dir_override(overrides)
    except ConfigError as e:
        return str(e)
    if run_dir is None:
        # a launch without run_dir gets a directory of its own: there would be nothing to resume
        return (f"resume={value} needs run_dir=<the run's directory>: without one every launch starts a new "
                "directory (runs/<run id>), which holds no checkpoint to continue")
    if resume is True and not Path(run_dir).exists():
        return (f"resume=true: run_dir={run_dir!r} does not exist, so there is no run to continue; resume=auto "
                "continues a run where there is one and starts one where there is none")
    return None


def _check_run_dir(overrides: list[str]) -> str | None:
    """Before Hydra writes `.hydra/` and a log file there: run_dir is a directory and no other launch holds it."""
    from longstraw_cli.config import ConfigError
    from longstraw_cli.safety import runlock

    try:
        run_dir = _run_dir_override(overrides)
    except ConfigError as e:
        return str(e)
    if run_dir is None:
        return None
    if Path(run_dir).exists() and not Path(run_dir).is_dir():
        return f"run_dir={run_dir!r} is a file, not a directory"
    return runlock.check(run_dir)


def hydra_quoted(arg: str) -> str:
    """`key=~/path` for a path key (config.PATH_KEYS), quoted for Hydra's grammar, where `~` (its delete prefix)
    cannot stand in an unquoted value: a shell leaves `task.path=~/x` as it is (no tilde expansion after
    `key.sub=`), and config.py expands it. A value with quotes, brackets, braces, commas or spaces is Hydra's
    grammar's to read, as it is."""
    key, sep, value = arg.partition("=")
    if not sep or "~" not in value or re.search(r"[\s'\"\\,\[\]{}()]", value):
        return arg
    from longstraw_cli.config import PATH_KEYS

    return f"{key}='{value}'" if key.lstrip("+") in PATH_KEYS else arg


def _train_config(cfg, run_dir: str, set_keys: tuple[str, ...] = ()):
    """The composed job config (without its hydra node) as a TrainConfig, run_dir null given `run_dir`; a problem is
    one line and exit 2 (its traceback with HYDRA_FULL_ERROR=1)."""
    from omegaconf.errors import InterpolationResolutionError

    from longstraw_cli.config import ConfigError, train_config

    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    try:
        missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not k.startswith("hydra"))
        if missing:
            _fail(f"missing value(s) for {missing}: set them on the command line, e.g. {missing[0]}=...")
        container = OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as e:
        if full_error:
            raise
        # '${HOME}' in quotes reaches Hydra, which reads it as a reference to a config key
        _fail(f"{e.full_key}: {str(e).splitlines()[0]}; an environment variable is $VAR (or ${{oc.env:VAR}})")
    if container["run_dir"] is None:
        container["run_dir"] = run_dir
    try:
        return train_config(container, set_keys=set_keys)
    except ConfigError as e:
        if full_error:
            raise
        _fail(str(e))


def _checked_job(overrides: list[str]) -> str:
    """Before Hydra writes anything: the job's config composed and checked as `_task` checks it, so that a refused
    launch leaves no run dir behind (one line, exit 2); -> the run dir Hydra will make (this launch's run id is
    drawn once: `_run_id`)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException
    from omegaconf import open_dict, read_write

    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
    except HydraException as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        _fail(f"cannot compose the config from {overrides}: {str(e).splitlines()[0]}")
    run_dir = str(OmegaConf.select(cfg, "hydra.run.dir"))
    # a value that reads Hydra's own config (`${hydra:runtime.output_dir}`) resolves as it will in the job
    with read_write(cfg), open_dict(cfg):
        cfg.hydra.runtime.output_dir = os.path.abspath(run_dir)  # as Hydra sets it
    HydraConfig.instance().set_config(cfg)
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    _train_config(cfg, run_dir)
    return run_dir


def _make_run_dir(run_dir: str) -> str | None:
    """The run dir made before Hydra would (where a failure is Hydra's traceback); one line where it cannot be."""
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"run_dir={run_dir!r} cannot be made: {e.strerror or e}"
    if not os.access(run_dir, os.W_OK | os.X_OK):
        return f"run_dir={run_dir!r} is not writable"
    return None


def _remove_refused(run_dir: str) -> None:
    """A launch refused at set-up (a bad data row, reward or tokenizer) leaves no directory behind where it made it:
    it holds Hydra's .hydra/ and a log of the line already printed. One process only: under torchrun another rank
    may still be writing its log there."""
    if os.environ.get("WORLD_SIZE", "1") == "1":
        shutil.rmtree(run_dir, ignore_errors=True)


def _task(cfg, made_run_dir: bool = False) -> None:
    """The job Hydra runs; `made_run_dir`: this launch made the run dir (removed again on a refused set-up)."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    # this job's overrides (a sweep's included): a notice names only what the user set
    set_keys = tuple(o.partition("=")[0].lstrip("+~") for o in hydra_cfg.overrides.task)
    train_cfg = _train_config(cfg, hydra_cfg.runtime.output_dir, set_keys)
    from longstraw_cli.safety.errors import RunError
    from longstraw_cli.safety.runlock import RunLock, RunLockError
    from longstraw_cli.telemetry.progress import notice
    from longstraw_cli.trainer import Trainer

    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    trainer = None
    # rank 0 writes run_dir: it holds the lock (the other ranks' CLI asked before Hydra wrote anything)
    lock = RunLock(train_cfg.run_dir) if os.environ.get("RANK", "0") == "0" else contextlib.nullcontext()
    try:
        with lock:
            # set-up errors (a bad file, tokenizer, reward spec) are the user's input: one line; errors while
            # training are not, and keep their traceback, but for the ones that stop a run (safety/errors.py)
            try:
                trainer = Trainer(train_cfg)
            except (ValueError, ImportError) as e:
                if full_error:
                    raise
                if made_run_dir:
                    _remove_refused(train_cfg.run_dir)
                _stop(e, every_rank=False)
            # after set-up, whose errors stay one line: where this run's logs, metrics and checkpoints go
            where = f"run dir {Path(train_cfg.run_dir).resolve()}"
            if hydra_cfg.mode == RunMode.MULTIRUN:
                where += f" (sweep job {hydra_cfg.job.num} in {Path(hydra_cfg.sweep.dir).resolve()})"
            notice(where, _rank())
            _warn_if_planned_over(cfg, trainer)
            trainer.train()
    except RunError as e:
        if full_error:
            raise
        # not where another launch holds the lock: it may have made the directory at the same moment
        if trainer is None and made_run_dir and not isinstance(e, RunLockError):
            _remove_refused(train_cfg.run_dir)
        _stop(e)


def _warn_if_planned_over(cfg, trainer) -> None:
    """On a GPU, before step 0: one line where the plan of this run exceeds the GPU's memory (`preflight`), so a
    run that would run out of memory in its first replay says so before its rollout. Only where the task's prompts
    are prompt_tokens long; a config the planner cannot model is skipped, in the log."""
    if trainer.device.type != "cuda" or not trainer.task.uses_prompt_tokens:
        return
    from longstraw_cli.resident.offload import device_total_bytes

    try:
        line = preflight(cfg, device_total_bytes(trainer.device))
    except Exception as e:  # noqa: BLE001 - an estimate only: never stops a run
        from longstraw_cli.safety.errors import first_line

        logging.getLogger("longstraw").info("no memory plan for this run (%s)", first_line(e))
        return
    if line is not None:
        from longstraw_cli.telemetry.progress import notice

        notice(line, _rank())


def parse_train_argv(argv: list[str]):
    """`longstraw train`'s arguments as Hydra gets them (hydra_quoted), and Hydra's parse of them."""
    from hydra._internal.utils import get_args_parser

    argv = [hydra_quoted(arg) for arg in argv]
    return argv, get_args_parser().parse_known_args(argv)[0]


def train(argv: list[str]) -> int:
    import hydra

    from longstraw_cli.safety.preemption import ABORTED, recorded_outcome

    argv, args = parse_train_argv(argv)
    # a new launch: its own run id (a second launch in this process, as tests make, gets another)
    _run_id.cache_clear()
    # one job that trains: nothing is written before its config has passed the checks (a sweep's jobs are checked
    # each in its own directory, as Hydra makes them; --cfg, --info and the like train nothing and use no run dir)
    one_job = not (args.help or args.hydra_help or args.multirun or args.cfg or args.info
                   or args.shell_completion or args.experimental_rerun)
    if not (args.help or args.hydra_help):
        problem = check_overrides(args.overrides, multirun=args.multirun) or _check_resume(args.overrides)
        if not problem and one_job:
            problem = _check_run_dir(args.overrides)
        if problem:
            _fail(problem)
    with recorded_outcome():
        made_run_dir = one_job and _prepare_run_dir(args.overrides)

        def task(cfg) -> None:
            _task(cfg, made_run_dir)

        sys.argv = ["longstraw-train", *argv]
        main = hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(task)
        try:
            main()
        except KeyboardInterrupt:
            # the training loop takes a first SIGINT as a request to stop with a checkpoint (safety/preemption.py)
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            _fail("SIGINT outside the training loop: stopped, without a checkpoint", ABORTED, "interrupted")
    return 0


def _prepare_run_dir(overrides: list[str]) -> bool:
    """The job's config checked, then its run dir made (`_checked_job`, `_make_run_dir`; one line and exit 2 on a
    problem); -> whether this launch made it."""
    run_dir = _checked_job(overrides)
    made = not Path(run_dir).exists()
    problem = _make_run_dir(run_dir)
    if problem:
        _fail(problem)
    return made


# `longstraw plan`'s keys beyond the training config's
PLAN_KEYS = {"gpu_mem_gib": "GPU memory per rank in GiB (default 139: an H200)",
             "host_mem_gib": "host memory per rank for offloaded pages in GiB (default 128: an H200 machine's share)",
             "plan_kernels": "the kernels whose saved tensors the plan counts: auto | gpu | reference (default auto: "
                             "gpu for bf16/fp16; the run's own choices are kernels.*)"}
PLAN_USAGE = """usage: longstraw plan [overrides]   (the same: python -m longstraw_cli.plan [overrides])
The per-rank memory of one transaction by phase, and the longest prompt that fits per placement, for the run
that `longstraw train` would launch with the same overrides and defaults (model, cp, ep, group_size,
prompt_tokens, response_tokens, model.dtype, lora.rank, lora.quantize, capture.*). prompt_tokens and
response_tokens take K/M suffixes (2M = 2097152); prompt_tokens takes a comma list, one row each
(prompt_tokens=256K,1M,2M).
Plan's own keys: """ + "; ".join(f"{k}: {v}" for k, v in PLAN_KEYS.items()) + """
examples: longstraw plan model=qwen36 cp=8 prompt_tokens=2M group_size=8 lora.rank=16 gpu_mem_gib=139
          longstraw plan model=glm52 cp=32 ep=32 prompt_tokens=256K,1M,2M lora.rank=16 lora.quantize=nf4"""


def _plan_tokens(key: str, value: str) -> list[int]:
    """A token count or, for prompt_tokens, a comma list of them (K/M suffixes); one line on a bad value."""
    from longstraw_cli.config import ConfigError, parse_tokens

    texts = value.strip("[]").split(",") if key == "prompt_tokens" else [value]
    try:
        return [parse_tokens(text.strip(), key) for text in texts]
    except ConfigError as e:
        _fail(str(e))


def plan(argv: list[str]) -> int:
    from hydra import compose, initialize_config_dir

    from longstraw_cli import plan as planner
    from longstraw_cli.config import ConfigError

    if any(a in ("-h", "--help") for a in argv):
        print(PLAN_USAGE)
        return 0
    own, overrides, prompts = {"gpu_mem_gib": "139", "host_mem_gib": "128", "plan_kernels": "auto"}, [], None
    # a path key's ~ quoted for Hydra's grammar, as train does
    for arg in map(hydra_quoted, argv):
        key, sep, value = arg.partition("=")
        if sep and key in PLAN_KEYS:
            own[key] = value
        elif sep and key in ("prompt_tokens", "response_tokens"):
            counts = _plan_tokens(key, value)
            if key == "prompt_tokens":
                prompts = counts
            # Hydra composes one value (a comma list would be a sweep); the plan takes every prompt length
            overrides.append(f"{key}={counts[0]}")
        else:
            overrides.append(arg)
    problem = check_overrides(overrides, own_keys=tuple(PLAN_KEYS))
    if problem:
        _fail(problem)
    gib = {}
    for key in ("gpu_mem_gib", "host_mem_gib"):
        try:
            gib[key] = float(own[key])
        except ValueError:
            _fail(f"{key}={own[key]!r} is not a number (GiB)")
    if own["plan_kernels"] not in planner.KERNELS:
        _fail(f"plan_kernels={own['plan_kernels']!r}; valid: {list(planner.KERNELS)}")
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    # the training config's own checks of model.name / path / dtype
    try:
        model_cfg, title, common = plan_arguments(cfg, gpu_mem_gib=gib["gpu_mem_gib"],
                                                  host_mem_gib=gib["host_mem_gib"], kernels=own["plan_kernels"])
    except (ConfigError, ValueError) as e:
        _fail(str(e))
    if OmegaConf.select(cfg, "rollout.engine") == "vllm":
        share = OmegaConf.select(cfg, "rollout.vllm.gpu_memory_utilization")
        print(f"rollout=vllm: vLLM's own memory (rollout.vllm.gpu_memory_utilization={share} of the GPU while it "
              "generates) is not planned; the rollout phase below is the native decode's")
    return planner.report(model_cfg, title, prompts or [OmegaConf.select(cfg, "prompt_tokens")], **common)


def plan_arguments(cfg, *, gpu_mem_gib: float, host_mem_gib: float, kernels: str = "auto"):
    """The planner's view of the run `longstraw train` launches from the composed config `cfg`: (the model's
    config, its name or path, the keyword arguments of `plan.plan` but prompt_tokens). ConfigError / ValueError on
    a bad value."""
    from longstraw_cli.config import ConfigError, ModelConfig, expand_paths, replay_routing_for
    from longstraw_cli.rl.losses import get_loss
    from longstraw_cli.rollout.native import NativeConfig

    model = ModelConfig(**expand_paths({"model": OmegaConf.to_container(cfg.model, resolve=True)})["model"])
    family, model_cfg = model.family_config()

    def integer(key: str) -> int:
        value = OmegaConf.select(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an integer")
        return value

    def number(key: str) -> float:
        value = OmegaConf.select(cfg, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a number")
        return float(value)

    engine = OmegaConf.select(cfg, "rollout.engine")
    algo = str(OmegaConf.select(cfg, "algo.name"))
    loss = get_loss(algo)
    replay_routing = replay_routing_for(algo, OmegaConf.select(cfg, "rollout.replay_routing", default="auto"))
    # the score phase runs a forward for the KL reference, or for given or vLLM responses whose old log-probs the
    # loss reads and the rollout did not give (a file's task.logprob_key does), or whose routing must be recorded
    # there (routing replay of responses that came with none)
    routes = family.routing_replay(replay_routing) is not None
    given_logprobs = engine == "data" and OmegaConf.select(cfg, "task.logprob_key") is not None
    scoring = number("algo.kl_coef") > 0 or (
        engine != "native" and loss.needs_old and (routes or not given_logprobs))
    common = dict(
        cp=integer("cp"), ep=integer("ep"), group_size=integer("group_size"),
        response_tokens=integer("response_tokens"), dtype=model.dtype, lora_rank=integer("lora.rank"),
        quantize=str(OmegaConf.select(cfg, "lora.quantize")), gpu_mem_gib=gpu_mem_gib,
        block_size=integer("capture.block_size"), score_batch=integer("capture.score_batch"),
        logprob_chunk=integer("capture.logprob_chunk"), kernels=kernels,
        gradient=str(OmegaConf.select(cfg, "capture.gradient")),
        walk_checkpoint=bool(OmegaConf.select(cfg, "capture.walk_checkpoint")),
        reuse=integer("capture.reuse_steps") > 1, probe_tokens=integer("capture.probe_tokens"),
        offload=str(OmegaConf.select(cfg, "capture.offload")), host_mem_gib=host_mem_gib,
        offload_copy_gib=OmegaConf.select(cfg, "rollout.native.offload_copy_gib", default="auto"),
        replay_routing=replay_routing,
        replay_block=integer("capture.replay_block"),
        # rollout=vllm has no native section: the native decode's default is planned
        response_chunk=(integer("rollout.native.response_chunk") if OmegaConf.select(cfg, "rollout.native")
                        else NativeConfig.response_chunk),
        scoring=scoring,
        # rollout=data | synthetic: no decode, no rollout phase
        decode=engine in ("native", "vllm"))
    integer("prompt_tokens")  # checked here; the callers take one length (train) or a list (plan) of their own
    return model_cfg, model.path or model.name, common


def preflight(cfg, gpu_bytes: int) -> str | None:
    """A line for the user where the plan of this run (composed config `cfg`, at its prompt_tokens) does not fit
    `gpu_bytes` of GPU memory per rank, naming the phase and, for whole-response replays, capture.replay_block;
    None where it fits. The plan is an estimate (within ~10% of measured peaks): a warning, not a refusal."""
    from longstraw_cli import plan as planner

    # the GPU's budget only: host memory is checked by the trainer itself (capture.offload)
    model_cfg, _, common = plan_arguments(cfg, gpu_mem_gib=gpu_bytes / planner.GIB, host_mem_gib=1e9)
    p = planner.plan(model_cfg, prompt_tokens=OmegaConf.select(cfg, "prompt_tokens"), **common)
    if p["peak"] <= p["budget"]:
        return None
    phase = max(p["phases"], key=p["phases"].get)
    blocks = planner.whole_response_advice(phase, common["replay_block"], common["response_tokens"])
    return (f"the plan puts this run's peak at {p['peak'] / planner.GIB:.1f} GiB per rank ({phase}), over this GPU's "
            f"{gpu_bytes / planner.GIB:.1f} GiB{'' if blocks is None else '; ' + blocks} (`longstraw plan` with the "
            "same overrides shows each phase)")
