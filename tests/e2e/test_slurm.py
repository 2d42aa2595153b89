"""scripts/slurm/train.sbatch under a real slurm: Debian's slurm-wlm and munge, started here as a one-node cluster
on localhost (proctrack/linuxproc, task/none, no GPUs), in a temp dir with its own munge key and socket; every
daemon started here is stopped at the end. Skipped, in one line, where slurm is not installed or not root.

Three jobs with the tiny default model run side by side, each driven by a signal once its trainer logs a step:
- preempted: `scancel --batch --signal=USR1` -> the trainer checkpoints and stops, the script requeues the job once,
  the job resumes from the checkpoint and completes, every step logged once, no step of the job recorded failed;
- cancelled: a plain `scancel` -> the trainer checkpoints (slurm's SIGTERM), the script says so and exits 0;
- finished: SIGUSR1 during the last step -> the trainer finishes, and the script does not requeue it.
Slurm records a job's final states only through accounting (slurmdbd, a database); here jobcomp/filetxt records
each end of a job (a requeue included) with its DerivedExitCode, the highest exit status of its steps."""

import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import free_ports, rows

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm" / "train.sbatch"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel")
TINY = ["prompt_tokens=64", "response_tokens=4", "group_size=2", "logger.backends=[jsonl]", "checkpoint.every=100"]
# steps per job: enough that the signal comes mid-run, or (finished) during the last step
STEPS = {"preempted": 6, "cancelled": 400, "finished": 2}
TIMEOUT_S = 170

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
# here, not in the fixture: one line for the module, not one for each test
if missing := [d for d in DAEMONS if shutil.which(d) is None]:
    pytest.skip(f"slurm: {missing} not installed (apt-get install slurm-wlm munge)", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("slurm: slurmd runs the jobs as root here, and this test is not root", allow_module_level=True)


def slurm_conf(root: Path, host: str, ports: list[int]) -> str:
    return f"""ClusterName=longstraw
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire (120 s by default) also holds a requeued job back that long before it may start again
AuthInfo=socket={root}/munge.socket,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
# the scheduler's pass every 2 s, not 60: a requeued job starts once it may
SchedulerParameters=sched_interval=2
KillWait=30
MinJobAge=600
SlurmctldTimeout=10
SlurmdTimeout=10
# the node declares 4 CPUs on however many there are: the three one-CPU jobs run side by side
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs=4 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Slurm:
    root: Path
    env: dict

    def __call__(self, *argv: str, check: bool = True) -> str:
        """A slurm command's stdout; with check=False, "" where it fails (a daemon that is not up)."""
        try:
            done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            if check:
                raise
            return ""
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
        return done.stdout if done.returncode == 0 else ""

    def job(self, job_id: str) -> dict:
        return dict(re.findall(r"(\w+)=(\S*)", self("scontrol", "show", "job", "-o", job_id)))

    def records(self, job_id: str) -> list[dict]:
        """jobcomp's records of one job, oldest first: one for each time it ended or was requeued."""
        path = self.root / "jobcomp.txt"
        lines = path.read_text().splitlines() if path.exists() else []
        return [r for r in (dict(re.findall(r"(\w+)=(\S*)", line)) for line in lines) if r["JobId"] == job_id]


def start(argv: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    (root / "state").mkdir()
    (root / "spool").mkdir()
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    host = socket.gethostname().split(".")[0]
    (root / "slurm.conf").write_text(slurm_conf(root, host, free_ports(2)))
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    daemons = [start(["munged", "--foreground", "--force", f"--socket={root}/munge.socket", f"--key-file={key}",
                      f"--pid-file={root}/munged.pid", f"--seed-file={root}/munged.seed",
                      f"--log-file={root}/munged.log"], root / "munged.out", env)]
    cluster = Slurm(root, env)
    try:
        time.sleep(0.5)
        daemons.append(start(["slurmctld", "-D", "-c"], root / "slurmctld.out", env))
        daemons.append(start(["slurmd", "-D", "-N", host], root / "slurmd.out", env))
        deadline = time.monotonic() + 30
        while cluster("sinfo", "-h", "-o", "%T", check=False).strip() != "idle":
            ended = [d.args[0] for d in daemons if d.poll() is not None]
            if ended or time.monotonic() > deadline:
                # the first daemon that ended, in its own last line; else no node came up in time
                why = ((root / f"{ended[0]}.out").read_text().strip().splitlines() or ["exited"])[-1] if ended \
                    else "no idle node within 30 s (slurmctld.log, slurmd.log)"
                pytest.skip(f"slurm: could not start: {ended[0] if ended else 'the node'}: {why[-200:]}")
            time.sleep(0.5)
        yield cluster
    finally:
        # the jobs first: slurmstepd outlives slurmd, and a job's trainers would outlive the test
        cluster("scancel", "--full", "--user=root", check=False)
        deadline = time.monotonic() + 45
        while cluster("squeue", "-h", check=False).strip() and time.monotonic() < deadline:
            time.sleep(1)
        for daemon in reversed(daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


@dataclass
class Job:
    name: str
    id: str
    dir: Path
    signalled: bool = False

    @property
    def out(self) -> str:
        path = self.dir / f"slurm-{self.id}.out"
        return path.read_text() if path.exists() else ""

    @property
    def run_dir(self) -> Path:
        return self.dir / "runs" / f"slurm-{self.id}"

    def logged_a_step(self) -> bool:
        metrics = self.run_dir / "metrics.jsonl"
        return metrics.exists() and metrics.read_text().count("\n") >= 1


@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory) -> dict[str, Job]:
    """The three jobs, run to their end: each signalled once its trainer has logged a step."""
    # this checkout's code in the jobs; the script sets the threads itself
    env = {k: v for k, v in slurm.env.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    submitted = {}
    for name, steps in STEPS.items():
        work = tmp_path_factory.mktemp(name)
        job_id = subprocess.run(
            ["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", "--time=5", f"--chdir={work}",
             str(SCRIPT), *TINY, f"steps={steps}"], env=env, capture_output=True, text=True, check=True,
        ).stdout.strip()
        submitted[name] = Job(name, job_id, work)
    signal = {"preempted": ["--batch", "--signal=USR1"], "cancelled": [], "finished": ["--batch", "--signal=USR1"]}
    deadline = time.monotonic() + TIMEOUT_S
    while slurm("squeue", "-h", "-o", "%i").split():
        assert time.monotonic() < deadline, {j.name: j.out[-2000:] for j in submitted.values()}
        for job in submitted.values():
            if not job.signalled and job.logged_a_step():
                slurm("scancel", *signal[job.name], job.id, check=False)
                job.signalled = True
        time.sleep(0.2)
    return submitted


def steps_logged(job: Job) -> list[int]:
    return [r["step"] for r in rows(job.run_dir)]


def test_preempted_job_is_requeued_once_resumes_and_completes(slurm, jobs):
    job = jobs["preempted"]
    out = job.out
    assert "1 node(s) x 1 trainer(s) (0 GPU(s) on the node), 1 thread(s) each" in out, out
    assert out.count("requeueing job") == 1, out
    assert "Traceback" not in out, out
    state = slurm.job(job.id)
    assert (state["JobState"], state["Restarts"], state["ExitCode"]) == ("COMPLETED", "1", "0:0"), state
    # the requeue, then the end; no step failed in either (torchrun's exit 1 was the step's FAILED)
    records = slurm.records(job.id)
    assert len(records) == 2 and records[-1]["JobState"] == "COMPLETED", records
    assert [r["DerivedExitCode"] for r in records] == ["0:0", "0:0"], records
    # resumed from the checkpoint the signal wrote: every step logged once
    stopped = re.search(r"resume=true continues from step (\d+)", out)
    assert stopped and 1 <= int(stopped[1]) < STEPS["preempted"], out
    log = (job.run_dir / "train_rank0.log").read_text()
    assert f"starting at step {stopped[1]} of {STEPS['preempted']}" in log
    assert steps_logged(job) == list(range(STEPS["preempted"]))


def test_cancelled_job_leaves_a_checkpoint_and_no_failure(slurm, jobs):
    job = jobs["cancelled"]
    out = job.out
    assert re.search(rf"job {job.id} cancelled, preempted or at its time limit: all 1 trainer\(s\) wrote a "
                     r"checkpoint", out), out
    assert "Traceback" not in out and "requeueing" not in out, out
    state = slurm.job(job.id)
    # the script exited 0: the job is cancelled, not failed
    assert (state["JobState"], state["Restarts"], state["ExitCode"]) == ("CANCELLED", "0", "0:0"), state
    done = len(steps_logged(job))
    assert 1 <= done < STEPS["cancelled"]
    assert (job.run_dir / "checkpoints" / f"step_{done:08d}" / "COMPLETE").is_file()


def test_signal_in_the_last_step_finishes_without_a_requeue(slurm, jobs):
    job = jobs["finished"]
    out = job.out
    # the script caught the signal, the trainer finished its last step anyway: nothing to requeue
    assert "SIGUSR1: asking the trainers to stop" in out, out
    assert f"job {job.id} finished: all 1 trainer(s) completed their steps" in out, out
    assert "requeueing" not in out, out
    state = slurm.job(job.id)
    assert (state["JobState"], state["Restarts"], state["ExitCode"]) == ("COMPLETED", "0", "0:0"), state
    assert steps_logged(job) == list(range(STEPS["finished"]))
    # the time limit (5 minutes) is shorter than twice the default lead (600 s): the lead was scaled, in one line
    scaled = re.findall(r"LONGSTRAW_STOP_AHEAD_S=600 is more than half the (\d+) s the job has left: the trainers "
                        r"are asked to stop (\d+) s ahead", out)
    assert len(scaled) == 1 and int(scaled[0][1]) == int(scaled[0][0]) // 2 <= 150, out
