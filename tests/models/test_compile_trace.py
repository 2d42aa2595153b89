"""scripts/bench/compile_trace.py and bench_train's --trace-compiles: each Triton compile of a run, timed."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).parents[2] / "scripts" / "bench"

pytest.importorskip("triton")


def test_each_compile_is_a_line_and_the_module_runs_as_main(monkeypatch, tmp_path, capsys):
    import triton
    import triton.compiler
    import triton.compiler.compiler

    monkeypatch.syspath_prepend(str(BENCH))
    import compile_trace

    compiled = []
    # the real compiler stands aside (both names the wrapper replaces, put back after the test)
    monkeypatch.setattr(triton.compiler.compiler, "compile", lambda src, **kw: compiled.append(src) or "kernel")
    monkeypatch.setattr(triton.compiler, "compile", triton.compiler.compiler.compile)
    monkeypatch.setattr(triton, "compile", triton.compiler.compiler.compile)
    exits = []
    monkeypatch.setattr(compile_trace.atexit, "register", exits.append)
    # a job whose kernels hand the compiler what a kernel does: its function (name, argument names) and constants
    # keyed by argument path
    (tmp_path / "fake_job.py").write_text(
        "import sys, triton.compiler\n"
        "from types import SimpleNamespace\n"
        "def fake_source(name, arg_names, constants):\n"
        "    return SimpleNamespace(fn=SimpleNamespace(__name__=name, arg_names=arg_names), constants=constants)\n"
        "ARGV = list(sys.argv)\n"
        "assert __name__ == '__main__'\n"
        "for chunk in (2, 4):\n"
        "    assert triton.compiler.compile(fake_source('_select', ['s', 'CHUNK', 'DIGIT'],"
        " {(1,): chunk, (2,): 4}), target=None) == 'kernel'\n"
        "triton.compiler.compile(fake_source('_fwd', ['q'], {(0, 1): 'tf32'}))\n"
        "open(sys.argv[1], 'w').write(' '.join(ARGV))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "trace.jsonl"
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    compile_trace.main(["--out", str(out), "-m", "fake_job", str(tmp_path / "argv.txt"), "x"])

    assert len(compiled) == 3
    # as `python -m` gives it: the module's file first
    assert (tmp_path / "argv.txt").read_text() == f"{tmp_path / 'fake_job.py'} {tmp_path / 'argv.txt'} x"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kernel"] for r in rows] == ["_select", "_select", "_fwd"]
    assert [r["constants"] for r in rows] == [{"CHUNK": 2, "DIGIT": 4}, {"CHUNK": 4, "DIGIT": 4}, {"(0, 1)": "tf32"}]
    assert all(r["seconds"] >= 0 and r["ended"] > 0 for r in rows)
    s = compile_trace.summary(str(out))
    assert s["compiles"] == 3 and list(s["by_kernel"]) in (["_select", "_fwd"], ["_fwd", "_select"])
    assert s["by_kernel"]["_select"][0] == 2
    # the summary at exit
    (report,) = exits
    report()
    assert "compile_trace: 3 Triton compiles" in capsys.readouterr().err


def test_bench_train_launches_the_trainer_under_the_trace_and_keeps_its_summary(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_train

    launched = []

    def fake_run(cmd, env):
        launched.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        out.write_text(json.dumps({"kernel": "_select", "constants": {}, "seconds": 2.5, "thread": 1,
                                   "ended": 100.0}) + "\n")
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(bench_train.subprocess, "run", fake_run)
    args = SimpleNamespace(run_root=str(tmp_path), steps=2, out=None,
                           trace_compiles=str(tmp_path / "compiles.jsonl"))
    row = bench_train.run(65536, 1, ["model=glm52_mini"], args)
    (cmd,) = launched
    assert cmd[1].endswith("compile_trace.py") and cmd[4:6] == ["-m", "longstraw_cli"]
    assert cmd[3] == str(tmp_path / "compiles-65536.jsonl")
    assert row["compiles"]["compiles"] == 1 and row["compiles"]["by_kernel"] == {"_select": [1, 2.5]}
    # one process's compiles: not under torchrun
    for argv in (["--prompt", "1", "--nproc", "2"], ["--prompt", "1", "--cp", "1", "2"]):
        monkeypatch.setattr(sys, "argv", ["bench_train.py", *argv, "--trace-compiles", "t.jsonl"])
        with pytest.raises(SystemExit, match="2"):
            bench_train.main()
