"""`python -m longstraw_cli.plan [overrides]` = `longstraw plan [overrides]` (the command lives in cli.py, above
the planner: the planner never imports the command)."""

import sys

from longstraw_cli.cli import plan

sys.exit(plan(sys.argv[1:]))
