"""Run safety: what keeps a run's work when something goes wrong, and says in one line what did.

- errors.py: how a run ends (its one line on stderr and the exit status a script acts on); below all the others.
- guard.py: a step with a non-finite loss or gradient norm is not applied; too many in a row stop the run.
- preemption.py: SIGTERM, SIGUSR1 and a first SIGINT stop after the step with a checkpoint (exit 75).
- runlock.py: one writer per run_dir (an advisory lock).
- output.py: a stdout or stderr whose reader went away (a pipe into tee, Ctrl-C) never stops the program.
- watchdog.py: a collective that waits past dist_timeout_s stops the run, naming the collective.
- inputs.py: checks of prompts and reward values that the config cannot make, at load.
- typed.py: config values against their dataclass field's type (config.py's checks).

The modules import errors.py and nothing else of the package: the trainer and the CLI import them.
"""
