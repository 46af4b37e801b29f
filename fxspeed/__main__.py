"""`python -m fxspeed ...` runs the command line (see fxspeed.tools.cli)."""

import sys

from fxspeed.tools.cli import main

sys.exit(main())
