"""`python -m espn.cli`: the `espn` command without its console script."""

import sys

from . import main

sys.exit(main())
