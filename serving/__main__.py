"""``python -m serving``: the same as ``conflux-serve``."""

import sys

from serving.cli import main

sys.exit(main())
