"""`python -m longstraw_cli.plan [overrides]` = `longstraw plan [overrides]`."""

import sys

from longstraw_cli.plan import main

sys.exit(main())
