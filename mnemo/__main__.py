"""``python -m mnemo``: the command line."""

import sys

from mnemo.cli import main

sys.exit(main())
