"""A non-editable install (`pip install .`: the wheel) carries its Hydra configs: `longstraw train` runs its
embedded default from a directory outside the checkout, importing the installed copy, not the source tree."""

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_checkout_root_holds_no_top_level_module_but_ours():
    """`python -m longstraw_cli ...` and `python -m pytest` from the checkout put its root first on sys.path, so a
    package or module there named as another distribution's would replace it: the kernels' directory was `kernels/`,
    which shadowed Hugging Face's `kernels` once transformers (5.25) imported it where installed."""
    names = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()} | {p.stem for p in REPO.glob("*.py")}
    assert names and all(name.startswith("longstraw") for name in names), sorted(names)


def test_make_demo_installs_the_package_alone_and_make_test_the_test_extras():
    """`make demo` reinstalled the test extras (deepspeed, triton, torchao, ...) at every run; the demo needs none."""
    if shutil.which("make") is None:
        pytest.skip("no make here")

    def commands(target: str) -> str:
        return subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, check=True).stdout

    demo, test = commands("demo"), commands("test")
    assert "pip install -q -e .\n" in demo and "[test" not in demo and "longstraw_cli train" in demo
    assert 'pip install -q -e ".[test,plot,math]"' in test and "pytest" in test


# what the extras bring, and the GPU packages
EXTRAS = ("transformers", "triton", "deepspeed", "torchao", "datasets", "peft", "tensorboard", "matplotlib",
          "math_verify", "wandb", "fla", "vllm")


@pytest.mark.slow
def test_the_default_job_runs_without_any_extra(tmp_path):
    """`make demo`'s job (one step of it) with every extra's package unimportable."""
    block = "; ".join(f"sys.modules[{name!r}] = None" for name in EXTRAS)
    script = f"import sys; {block}; from longstraw_cli.__main__ import main; sys.exit(main(['train', 'steps=1']))"
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    [run] = (tmp_path / "runs").iterdir()
    assert (run / "checkpoints" / "step_00000001" / "COMPLETE").is_file()


@pytest.mark.slow
def test_wheel_installed_outside_the_checkout_trains(tmp_path):
    # build from a copy: a build/ directory left in the checkout could hold stale files
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", "build", "dist", "runs", "multirun",
                                                                "outputs", "*.egg-info", "__pycache__"))
    wheels = tmp_path / "wheels"
    # with a build backend here, no download; else pip fetches one into an isolated environment
    isolation = ["--no-build-isolation"] if _builds_wheels_here() else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", str(source), "-w",
                    str(wheels)], check=True, capture_output=True, text=True, timeout=300)
    [wheel] = wheels.glob("longstraw-*.whl")
    # every package of the source tree is in the wheel: an editable install beside it would otherwise supply a
    # missing subpackage from the checkout and the run below would not notice
    packages = {str(p.relative_to(REPO)) for name in ("longstraw_cli", "longstraw_kernels")
                for p in (REPO / name).rglob("__init__.py")}
    with zipfile.ZipFile(wheel) as archive:
        missing = packages - set(archive.namelist())
    assert not missing, f"packages missing from the wheel (setup.cfg's packages): {sorted(missing)}"
    # the dependencies (torch, hydra, ...) come from this Python, whatever environment it is: a venv's Python
    # makes venvs whose pyvenv.cfg names the base interpreter, so `system_site_packages` would see the base's
    # site-packages, not this venv's (nor a conda env's extra paths, nor PYTHONPATH). A .pth file listing this
    # interpreter's own import paths sees exactly what it sees; its entries are appended after the venv's own
    # site-packages, where the wheel goes, and .pth files inside them are not run (site.py appends a .pth line's
    # directory as it is), so an editable install's import hook there stays off
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    (Path(_site_packages(python)) / "outer_environment.pth").write_text("\n".join(_dependency_paths()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    shutil.rmtree(source)

    work = tmp_path / "elsewhere"
    work.mkdir()
    # PYTHONPATH (a checkout on it, as in `PYTHONPATH=. pytest`) would come before the installed copy
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([str(python), "-c", "import longstraw_cli.cli as c; print(c.CONF_DIR)"], cwd=work,
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(env_dir)) and (Path(where) / "config.yaml").is_file(), where
    out = subprocess.run([str(env_dir / "bin" / "longstraw"), "train", "steps=1", "prompt_tokens=64",
                          "response_tokens=4", "group_size=2", "logger.backends=[jsonl]"], cwd=work,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    [run] = (work / "runs").iterdir()
    assert (run / "metrics.jsonl").read_text().startswith('{"step": 0')
    assert (run / "checkpoints" / "step_00000001" / "COMPLETE").is_file()


def _builds_wheels_here() -> bool:
    """Whether this Python's setuptools builds our wheel: pyproject.toml's >= 64, and bdist_wheel, its own from
    70.1, the `wheel` package's before (a venv of Python 3.11 has setuptools 65 and no `wheel`)."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    version = tuple(int(part) for part in re.findall(r"\d+", importlib.metadata.version("setuptools"))[:2])
    return version >= (64,) and (version >= (70, 1) or importlib.util.find_spec("wheel") is not None)


def _site_packages(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _dependency_paths() -> list[str]:
    """This interpreter's import paths but the working directory, the checkout and any directory holding
    longstraw's packages (an editable install's path entry): the wheel must be the only copy. The standard
    library's entries are the venv's own already (site.py skips a .pth line it has)."""
    paths = []
    for entry in filter(None, sys.path):
        path = Path(entry).resolve()
        if (path.is_dir() and path != REPO and REPO not in path.parents
                and not any((path / name).exists() for name in ("longstraw_cli", "longstraw_kernels"))):
            paths.append(str(path))
    return paths
