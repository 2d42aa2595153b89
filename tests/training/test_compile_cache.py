"""Warm-up paid once (issue #32): Triton's and torch.compile's caches under compile_cache_dir, set before anything
compiles, the user's own cache variables kept, `compile_cache_dir=false` leaving everything alone; and a GPU run
without one of its fast paths (fla, Triton) saying so once, a CPU run not."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import longstraw_kernels
from conftest import composed
from longstraw_cli import compile_cache
from longstraw_cli.compile_cache import AUTOTUNE_ENV, INDUCTOR_ENV, TRITON_ENV
from longstraw_cli.config import ConfigError, train_config

REPO = Path(__file__).resolve().parents[2]
SMALL = ["prompt_tokens=32", "response_tokens=4", "group_size=2", "logger.backends=[jsonl]", "steps=1"]


@pytest.fixture
def clean_env(monkeypatch):
    """The cache variables unset; monkeypatch puts back whatever this process had, whatever setup writes."""
    for name in (TRITON_ENV, INDUCTOR_ENV, AUTOTUNE_ENV, "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_default_root_is_the_users_cache_directory(clean_env, tmp_path):
    assert compile_cache.default_root() == Path.home() / ".cache" / "longstraw"
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.default_root() == tmp_path / "longstraw"
    # the XDG spec: a relative XDG_CACHE_HOME is ignored
    clean_env.setenv("XDG_CACHE_HOME", "relative/dir")
    assert compile_cache.default_root() == Path.home() / ".cache" / "longstraw"


def test_setup_points_both_caches_under_the_directory(tmp_path):
    env = {}
    caches = compile_cache.setup(str(tmp_path / "cc"), env)
    assert env == {TRITON_ENV: str(tmp_path / "cc" / "triton"), INDUCTOR_ENV: str(tmp_path / "cc" / "inductor"),
                   AUTOTUNE_ENV: "1"}
    assert (tmp_path / "cc" / "triton").is_dir() and (tmp_path / "cc" / "inductor").is_dir()
    assert caches.describe() == (f"compile caches: Triton {tmp_path}/cc/triton, torch.compile {tmp_path}/cc/inductor;"
                                 f" rm -rf {tmp_path}/cc clears them")
    # again (a second Trainer in one process): the same
    assert compile_cache.setup(str(tmp_path / "cc"), env) == caches
    import torch._functorch.config
    import torch._inductor.config

    assert torch._inductor.config.fx_graph_cache and torch._functorch.config.enable_autograd_cache


def test_setup_defaults_to_xdg_cache_home(clean_env, tmp_path):
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path))
    env = {}
    compile_cache.setup(None, env)
    assert env[TRITON_ENV] == str(tmp_path / "longstraw" / "triton")
    assert env[INDUCTOR_ENV] == str(tmp_path / "longstraw" / "inductor")


def test_the_users_variables_are_kept(tmp_path):
    env = {TRITON_ENV: "/users/triton", AUTOTUNE_ENV: "0"}
    caches = compile_cache.setup(str(tmp_path), env)
    assert env == {TRITON_ENV: "/users/triton", INDUCTOR_ENV: str(tmp_path / "inductor"), AUTOTUNE_ENV: "0"}
    assert not (tmp_path / "triton").exists()
    assert "(yours: TRITON_CACHE_DIR)" in caches.describe()
    assert caches.describe().endswith(f"rm -rf {tmp_path} clears the ones under it")
    env = {TRITON_ENV: "/users/triton", INDUCTOR_ENV: "/users/inductor"}
    caches = compile_cache.setup(None, env)
    assert env[TRITON_ENV] == "/users/triton" and env[INDUCTOR_ENV] == "/users/inductor"
    assert caches.root is None and "rm -rf" not in caches.describe()


def test_torchs_own_default_counts_as_unset(tmp_path):
    # torch writes /tmp/torchinductor_$USER into TORCHINDUCTOR_CACHE_DIR the first time it looks (on import of
    # torch._inductor.config): that is not the user's choice
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env = {INDUCTOR_ENV: default_cache_dir()}
    compile_cache.setup(str(tmp_path), env)
    assert env[INDUCTOR_ENV] == str(tmp_path / "inductor")


def test_false_leaves_the_caches_alone(tmp_path):
    env = {INDUCTOR_ENV: "/tmp/torchinductor_x"}
    assert compile_cache.setup(False, env) is None
    assert env == {INDUCTOR_ENV: "/tmp/torchinductor_x"}


def test_a_directory_that_cannot_be_made_warns_and_runs_on(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    env = {}
    assert compile_cache.setup(str(tmp_path / "file" / "cc"), env) is None
    assert env == {}
    assert "compile caches: cannot make" in caplog.text


@pytest.mark.parametrize("value, message", [
    ("true", "compile_cache_dir=True; valid: null (the default: "),
    ("3", "compile_cache_dir=3 must be a string or true or false or null"),
    ("''", "compile_cache_dir=''; valid: null"),
])
def test_bad_settings_are_one_line(tmp_path, value, message):
    with pytest.raises(ConfigError) as e:
        _config(tmp_path, f"compile_cache_dir={value}")
    assert message in str(e.value)


def test_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        _config(tmp_path, f"compile_cache_dir={tmp_path / 'f'}")


def test_paths_are_expanded(clean_env, tmp_path):
    clean_env.setenv("LONGSTRAW_TEST_CACHE", "/somewhere")
    assert _config(tmp_path, "compile_cache_dir=$LONGSTRAW_TEST_CACHE/x").compile_cache_dir == "/somewhere/x"
    assert _config(tmp_path, "compile_cache_dir=false").compile_cache_dir is False
    assert _config(tmp_path).compile_cache_dir is None


def _config(tmp_path, *args):
    return train_config(composed([*SMALL, f"run_dir={tmp_path / 'run'}", *args]))


def _trainer(tmp_path, *args):
    from longstraw_cli.trainer import Trainer

    return Trainer(_config(tmp_path, *args))


def test_the_trainer_sets_the_caches_and_says_where(clean_env, tmp_path, capsys):
    trainer = _trainer(tmp_path, f"compile_cache_dir={tmp_path / 'cc'}")
    assert os.environ[TRITON_ENV] == str(tmp_path / "cc" / "triton")
    assert os.environ[INDUCTOR_ENV] == str(tmp_path / "cc" / "inductor")
    # said when training starts (`train`), not during the set-up, whose refusals stay one line
    assert "compile caches" not in capsys.readouterr().err
    trainer._speed_notices()
    err = capsys.readouterr().err
    assert err.count("longstraw: compile caches: ") == 1
    assert f"longstraw: {trainer.compile_caches.describe()}\n" in err
    # a CPU run: no word about GPU fast paths
    assert "fla" not in err and "Triton does not import" not in err


def test_compile_cache_dir_false_says_nothing(clean_env, tmp_path, capsys):
    _trainer(tmp_path, "compile_cache_dir=false")._speed_notices()
    assert TRITON_ENV not in os.environ
    assert "compile caches" not in capsys.readouterr().err


def test_missing_fast_paths_on_the_gpu_only(monkeypatch):
    import torch

    # this machine has no fla (the CPU tests block it: conftest.py) and has Triton
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert longstraw_kernels.missing_fast_paths(("fla", "triton"), cpu) == []
    monkeypatch.setattr(longstraw_kernels, "is_gpu", lambda device: True)
    assert longstraw_kernels.missing_fast_paths(("fla",), gpu) == [longstraw_kernels.FAST_PATHS["fla"].missing]
    monkeypatch.setitem(longstraw_kernels.FAST_PATHS, "triton",
                        longstraw_kernels.FastPath("no_such_module_here", "no triton"))
    assert longstraw_kernels.missing_fast_paths(("triton",), gpu) == ["no triton"]


@pytest.mark.parametrize("model, says_fla", [("qwen36_tiny", True), ("glm52_tiny", False)])
def test_a_gpu_run_without_fla_says_so_once(clean_env, tmp_path, capsys, monkeypatch, model, says_fla):
    # the device check patched: this CPU run takes the GPU's start-up path
    monkeypatch.setattr(longstraw_kernels, "is_gpu", lambda device: True)
    _trainer(tmp_path, f"model={model}", f"compile_cache_dir={tmp_path / 'cc'}")._speed_notices()
    err = capsys.readouterr().err
    line = f"longstraw: {longstraw_kernels.FAST_PATHS['fla'].missing}\n"
    assert err.count(line) == (1 if says_fla else 0), err
    assert "pip install flash-linear-attention" in line and "27x slower" in line


@pytest.mark.slow
def test_a_compile_on_cpu_writes_to_the_configured_cache_and_hits_it(tmp_path):
    """What a second launch finds: inductor's FX graph cache in compile_cache_dir, set after torch has written its
    own default into TORCHINDUCTOR_CACHE_DIR (the trainer's import order)."""
    script = textwrap.dedent(f"""
        import longstraw_cli.trainer, torch
        from torch._dynamo.utils import counters
        from longstraw_cli import compile_cache
        compile_cache.setup({str(tmp_path / 'cc')!r})
        def fn(x):
            return (x.sin() * 2).sum()
        torch.compile(fn)(torch.randn(8))
        first = dict(counters["inductor"])
        torch._dynamo.reset()
        counters.clear()
        torch.compile(fn)(torch.randn(8))
        print(first, dict(counters["inductor"]))
    """)
    env = {k: v for k, v in os.environ.items() if k not in (TRITON_ENV, INDUCTOR_ENV, AUTOTUNE_ENV)}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("{'fxgraph_cache_miss': 1} {'fxgraph_cache_hit': 1}"), out.stdout
    assert any((tmp_path / "cc" / "inductor" / "fxgraph").iterdir())
