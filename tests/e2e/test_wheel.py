"""A non-editable install (`pip install .`: the wheel) carries its Hydra configs: `longstraw train` runs its
embedded default from a directory outside the checkout, importing the installed copy, not the source tree."""

import importlib.util
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_installed_outside_the_checkout_trains(tmp_path):
    # build from a copy: a build/ directory left in the checkout could hold stale files
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", "build", "dist", "runs", "multirun",
                                                                "outputs", "*.egg-info", "__pycache__"))
    wheels = tmp_path / "wheels"
    # with setuptools here, no download; else pip fetches the build backend into an isolated environment
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", str(source), "-w",
                    str(wheels)], check=True, capture_output=True, text=True, timeout=300)
    [wheel] = wheels.glob("longstraw-*.whl")
    # every package of the source tree is in the wheel: an editable install beside it would otherwise supply a
    # missing subpackage from the checkout and the run below would not notice
    packages = {f"longstraw_cli/{p.relative_to(REPO / 'longstraw_cli')}" for p in (REPO / "longstraw_cli").rglob(
        "__init__.py")} | {f"longstraw_kernels/{p.relative_to(REPO / 'kernels')}" for p in (REPO / "kernels").rglob(
        "__init__.py")}
    with zipfile.ZipFile(wheel) as archive:
        missing = packages - set(archive.namelist())
    assert not missing, f"packages missing from the wheel (setup.cfg's packages): {sorted(missing)}"
    # the dependencies (torch, hydra, ...) come from this Python; the venv's own copy of longstraw shadows any
    # editable install there
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    shutil.rmtree(source)

    work = tmp_path / "elsewhere"
    work.mkdir()
    where = subprocess.run([str(python), "-c", "import longstraw_cli.cli as c; print(c.CONF_DIR)"], cwd=work,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(env_dir)) and (Path(where) / "config.yaml").is_file(), where
    out = subprocess.run([str(env_dir / "bin" / "longstraw"), "train", "steps=1", "prompt_tokens=64",
                          "response_tokens=4", "group_size=2", "logger.backends=[jsonl]"], cwd=work,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    [run] = (work / "runs").iterdir()
    assert (run / "metrics.jsonl").read_text().startswith('{"step": 0')
    assert (run / "checkpoints" / "step_00000001" / "COMPLETE").is_file()
