"""`python -m espn.cli`: the `espn` command without its console script."""

import sys

from .app import main

sys.exit(main())
