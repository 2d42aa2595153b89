"""`python -m longstraw_cli.plan [overrides]` = `longstraw plan [overrides]` (the command lives in cli.py, above
the planner: the planner never imports the command)."""

import sys

from longstraw_cli.cli import plan
from longstraw_cli.safety.output import guard_console

# `... | head -4`: the rest of the table goes nowhere, without a traceback
guard_console()
sys.exit(plan(sys.argv[1:]))
