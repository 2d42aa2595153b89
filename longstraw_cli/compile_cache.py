"""Compile caches that outlive the process: a second launch on the same machine does not pay the JIT again.

Step 0 of a GPU run pays one-time work: Triton compiles the capture kernels (fla's GDN, ours), fla autotunes its
kernels, and torch.compile (dynamo + inductor, which generates and compiles Triton kernels too) builds the decode
step (issue #32: ~55-60 s of step 0 for qwen36_mini at 256K on an H200). Each of these keeps its result on disk:
- Triton: compiled kernels under TRITON_CACHE_DIR (Triton's default: ~/.triton/cache), and with
  TRITON_CACHE_AUTOTUNING=1 the timings of every `triton.autotune` (keyed by kernel source, GPU target and tuning
  key: a different GPU or kernel tunes afresh). fla turns it on for its own kernels already (FLA_CACHE_RESULTS);
- inductor: the FX graph cache (compiled graphs and their generated code), the AOTAutograd cache and its
  autotuning results, under TORCHINDUCTOR_CACHE_DIR (torch's default: /tmp/torchinductor_$USER, lost at reboot
  and on tmp cleaners).
`setup` points both under one directory the user owns, `compile_cache_dir` (null: $XDG_CACHE_HOME/longstraw, else
~/.cache/longstraw), `triton/` and `inductor/` below it, before anything compiles. What it leaves alone: a
TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_AUTOTUNING the user set (torch writes its own default
into TORCHINDUCTOR_CACHE_DIR the first time it looks, on import of torch._inductor.config: that value counts as
unset), and everything with `compile_cache_dir=false`. Dynamo's tracing is not cached by torch: a warm launch
still traces the decode step (seconds), then finds the compiled graph on disk.

Under torchrun every rank sets the same directories: Triton writes each cache entry to a temporary file and
renames it into place, inductor writes atomically too, so ranks (and concurrent runs) share them safely; the first
launch's ranks may compile the same kernel side by side, one of the identical results wins.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("longstraw")

TRITON_ENV, INDUCTOR_ENV, AUTOTUNE_ENV = "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_AUTOTUNING"
# the values `setup` wrote, so that a second call in this process (a sweep's next job) does not take them for the
# user's
_WRITTEN: dict[str, str] = {}


def default_root() -> Path:
    """$XDG_CACHE_HOME/longstraw, or ~/.cache/longstraw (the XDG spec ignores a relative XDG_CACHE_HOME)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "longstraw"


def check_setting(setting) -> str | None:
    """`compile_cache_dir`'s problem as one line, or None: null, false or a directory."""
    if setting is None or setting is False:
        return None
    if not isinstance(setting, str) or not setting.strip():
        return (f"compile_cache_dir={setting!r}; valid: null (the default: {default_root()}), false (leave the "
                f"Triton and torch.compile caches as they are) or a directory")
    if Path(setting).exists() and not Path(setting).is_dir():
        return f"compile_cache_dir={setting!r} is a file, not a directory"
    return None


def _torch_default_inductor_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return os.path.abspath(default_cache_dir())


def _users(name: str, environ) -> str | None:
    """The user's value of a cache variable, or None: unset, empty, written by `setup`, or torch's own default
    written by torch."""
    value = environ.get(name) or None
    if value is not None and value == _WRITTEN.get(name):
        return None
    if name == INDUCTOR_ENV and value is not None and os.path.abspath(value) == _torch_default_inductor_dir():
        return None
    return value


@dataclass(frozen=True)
class CompileCaches:
    """Where Triton and inductor keep their caches for this process, and which of them the user chose."""

    triton: str
    inductor: str
    # the variables the user had set, which setup left as they were
    users: tuple[str, ...] = ()
    # the directory setup made them under (None: both are the user's)
    root: str | None = None

    def describe(self) -> str:
        """The console's one line."""
        mine = f" (yours: {', '.join(self.users)})" if self.users else ""
        clear = f"; rm -rf {self.root} clears {'the ones under it' if self.users else 'them'}" if self.root else ""
        return f"compile caches: Triton {self.triton}, torch.compile {self.inductor}{mine}{clear}"


def setup(setting: str | bool | None = None, environ=None) -> CompileCaches | None:
    """Point Triton's and inductor's caches at `setting` (a directory; None: `default_root()`), as environment
    variables, and turn on Triton's autotuning cache and inductor's caches. None with `setting` false, or where
    the directory cannot be made (a warning says so; the run goes on with the libraries' own defaults). Call it
    before anything compiles; calling it again with the same setting changes nothing."""
    environ = os.environ if environ is None else environ
    problem = check_setting(setting)
    if problem:
        raise ValueError(problem)
    if setting is False:
        return None
    root = Path(os.path.abspath(os.path.expanduser(setting))) if setting else default_root()
    users = tuple(name for name in (TRITON_ENV, INDUCTOR_ENV) if _users(name, environ) is not None)
    wanted = {TRITON_ENV: root / "triton", INDUCTOR_ENV: root / "inductor"}
    try:
        for name, path in wanted.items():
            if name not in users:
                path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("compile caches: cannot make %s (%s); Triton and torch.compile keep their own cache "
                    "directories (set compile_cache_dir=DIR to choose another)", root, e)
        return None
    for name, path in wanted.items():
        if name not in users:
            environ[name] = _WRITTEN[name] = str(path)
    environ.setdefault(AUTOTUNE_ENV, "1")
    _inductor_caches_on()
    return CompileCaches(triton=environ[TRITON_ENV], inductor=environ[INDUCTOR_ENV], users=users,
                         root=None if len(users) == len(wanted) else str(root))


def _inductor_caches_on() -> None:
    """inductor's FX graph, AOTAutograd and autotuning caches on (their defaults in torch 2.11 and 2.13; a user's
    TORCHINDUCTOR_FX_GRAPH_CACHE=0 or TORCHINDUCTOR_AUTOGRAD_CACHE=0 still wins: torch reads those over these)."""
    try:
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config
    except ImportError:
        return
    for config, name in ((inductor_config, "fx_graph_cache"), (inductor_config, "autotune_local_cache"),
                         (functorch_config, "enable_autograd_cache")):
        if hasattr(config, name):
            setattr(config, name, True)
