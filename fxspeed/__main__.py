"""`python -m fxspeed ...` runs the command line (see fxspeed.cli)."""

import sys

from fxspeed.tools.cli import main

sys.exit(main())
