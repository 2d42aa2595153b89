"""Autotuned kernel choices recorded on a GPU model and shipped: a fresh machine's first launch skips the autotuning.

fla autotunes most of its Triton kernels on first use: every candidate config of every kernel is compiled and
timed, then the fastest runs. Triton keeps the winners on disk (TRITON_CACHE_AUTOTUNING, compile_cache.py), so a
second launch on the same machine skips it; a first launch on a fresh machine does not (issue #32: step 0 of the
first launch). `record` reads the choices the autotuners made in this process; `seed` gives them back to the
autotuners of another process before their first call, so that only the chosen config compiles.

What is filled is Triton's own per-process table (`Autotuner.cache`), keyed as Triton keys it: the tuning
arguments' values, then the tensor arguments' dtypes. A call whose key is not in the file autotunes as before. A
recorded choice is used only when it is one of the kernel's own candidate configs, under the same Triton and the
same version of the kernels' package. A GPU model with a file of its own takes that file; one without takes the file
of a model of its architecture (the same compute capability: an H100 PCIe or an H800 takes the H100 80GB's), the
model whose name shares the most with its own: sm90's candidates are one list and its choices nearly one (8 of 10
the same between the H100 and the H200, 2026-12-06). A GPU of an architecture no file was recorded on tunes for
itself, once per machine, as before.

Files: autotuned/<GPU>.json beside this module (<GPU>: the CUDA device name with each run of characters other
than letters and digits made one "_", e.g. NVIDIA_H200), written by scripts/bench/record_autotune.py.
`kernels.autotuned=false` leaves every autotuner to tune for itself.
"""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import re
import warnings
from pathlib import Path

from longstraw_kernels.config import kernels

log = logging.getLogger(__name__)

SHIPPED_DIR = Path(__file__).parent / "autotuned"


def gpu_tag(name: str) -> str:
    """A GPU's name as a file name: NVIDIA H200 -> NVIDIA_H200."""
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_") or "unknown_gpu"


def _autotuner_type():
    from triton.runtime.autotuner import Autotuner

    return Autotuner


def _base_fn(autotuner):
    """The Python function under an autotuner's decorators (Triton keeps it as `base_fn`)."""
    fn = getattr(autotuner, "base_fn", None) or autotuner.fn
    while not callable(fn) or hasattr(fn, "fn"):
        fn = fn.fn
    return fn


def _version(package: str) -> str | None:
    try:
        return getattr(importlib.import_module(package), "__version__", None)
    except ImportError:
        return None


def _versions(modules) -> dict[str, str | None]:
    """The version of each package the recorded kernels come from (None: it does not import), and Triton's."""
    return {"triton": _version("triton"), **{p: _version(p) for p in sorted({m.split(".")[0] for m in modules})}}


def record(prefix: str, gpu: str, capability: tuple[int, int] | None = None) -> dict:
    """The choices made so far in this process by the autotuners of modules under `prefix` (e.g. "fla."), for the
    file of `gpu` (a device name) of compute `capability`. Autotuners of one config choose nothing and are left
    out."""
    entries = []
    with warnings.catch_warnings():  # a scan of every object touches deprecated ones (torch.distributed.reduce_op)
        warnings.simplefilter("ignore")
        # by type: isinstance on a dead weak proxy raises
        autotuners = [obj for obj in gc.get_objects() if issubclass(type(obj), _autotuner_type())]
    for obj in autotuners:
        if len(obj.configs) <= 1:
            continue
        fn = _base_fn(obj)
        if not fn.__module__.startswith(prefix):
            continue
        for key, config in obj.cache.items():
            entries.append({"module": fn.__module__, "name": fn.__name__, "key": list(key),
                            "config": config.all_kwargs()})
    entries.sort(key=lambda e: (e["module"], e["name"], json.dumps(e["key"])))
    return {"gpu": gpu_tag(gpu), "compute_capability": None if capability is None else list(capability),
            "versions": _versions(e["module"] for e in entries), "entries": entries}


def merged(old: dict, new: dict) -> dict:
    """Two recordings of one GPU model and versions as one: `new`'s choice where both hold a kernel's key. Files of
    another GPU or version are refused (ValueError): they would be used, or dropped, together."""
    if old.get("gpu") != new["gpu"] or old.get("versions") != new["versions"]:
        raise ValueError(f"a recording of {old.get('gpu')} {old.get('versions')} cannot take one of {new['gpu']} "
                         f"{new['versions']}: write it to a file of its own")
    entries = {(e["module"], e["name"], json.dumps(e["key"])): e for e in [*old["entries"], *new["entries"]]}
    return {**new, "entries": [entries[k] for k in sorted(entries)]}


def _find(module: str, name: str):
    """The autotuner of `module.name` (under any decorators above it), or None (the module does not import or has
    no such kernel: another version)."""
    try:
        obj = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    while obj is not None and not isinstance(obj, _autotuner_type()):
        obj = getattr(obj, "fn", None)
    return obj


def seed(data: dict) -> tuple[int, str | None]:
    """Give recorded choices to the kernels' autotuners (their modules imported here) -> (keys seeded, why none
    were: None when some were or the file holds none). A key the autotuner already holds keeps its own choice; a
    recorded config that is not one of the kernel's candidates is skipped."""
    entries = data.get("entries", [])
    wanted = _versions(e["module"] for e in entries)
    recorded = data.get("versions", {})
    stale = [f"{p} {recorded.get(p)} (here {v})" for p, v in wanted.items() if recorded.get(p) != v]
    if stale:
        return 0, "recorded under " + ", ".join(stale)
    seeded = 0
    for entry in entries:
        autotuner = _find(entry["module"], entry["name"])
        if autotuner is None:
            continue
        config = next((c for c in autotuner.configs if c.all_kwargs() == entry["config"]), None)
        key = tuple(entry["key"])
        if config is not None and key not in autotuner.cache:
            autotuner.cache[key] = config
            seeded += 1
    return seeded, None


_SEEDED: set[str] = set()


def shipped_file(gpu: str, capability: tuple[int, int] | None = None) -> Path | None:
    """The shipped file that serves `gpu` (a device name) of compute `capability`: its own, else one recorded on a
    GPU of the same capability, the one whose name shares the longest start with `gpu`'s (then by name); None."""
    own = SHIPPED_DIR / f"{gpu_tag(gpu)}.json"
    if own.exists() or capability is None:
        return own if own.exists() else None
    tag, kin = gpu_tag(gpu), []
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        recorded = json.loads(path.read_text()).get("compute_capability")
        if recorded is not None and tuple(recorded) == tuple(capability):
            shared = len(os.path.commonprefix([tag, path.stem]))
            kin.append((-shared, path.name, path))
    return min(kin)[2] if kin else None


def seed_shipped(gpu: str, prefix: str, capability: tuple[int, int] | None = None) -> int:
    """Seed the autotuners of modules under `prefix` from the file shipped for `gpu` (a device name; `shipped_file`:
    its own, or one of its architecture's), once per process and prefix -> keys seeded (0: no file serves this GPU,
    kernels.autotuned=false, another version, or done before). Says in one log line what it did."""
    if not kernels().autotuned or prefix in _SEEDED:
        return 0
    _SEEDED.add(prefix)
    path = shipped_file(gpu, capability)
    if path is None:
        log.debug("no autotuned configs shipped for %s (sm%s): its kernels autotune on first use", gpu,
                  "".join(map(str, capability or ())))
        return 0
    if path.stem != gpu_tag(gpu):
        log.info("no autotuned configs recorded on %s: those of %s, the same architecture, serve it", gpu, path.stem)
    data = json.loads(path.read_text())
    data["entries"] = [e for e in data.get("entries", []) if e["module"].startswith(prefix)]
    seeded, problem = seed(data)
    if problem:
        log.info("autotuned configs for %s not used (%s): the kernels autotune on first use", gpu, problem)
    else:
        log.info("autotuned configs for %s: %d kernel choices from %s (%s: tune afresh)", gpu, seeded,
                 path.name, "kernels.autotuned=false")
    return seeded
