"""`espn serve` that kills itself with SIGKILL the N-th time the live-index writer reaches a step.

ESPN_TEST_CRASH_AT=step:N (steps are the `checkpoint` names of espn.live's writer, compaction
and replication, all through the one hook of espn.files.crash_points). With ESPN_TEST_CRASH_ARMED_BY=PATH
the count starts only once PATH exists, so a test picks the moment (the N-th upload after it
armed the crash is in the middle of a publish). Run with --workers 1, so the server is this
process. Used by tests/test_live_restart.py, tests/test_replication.py and
benchmarks/soak_scaleout.py: the real `espn serve` with one test hook set.
"""

import os
import signal
import sys

import espn.files.crash_points as crash_points
from espn.cli import main

step, _, count = os.environ["ESPN_TEST_CRASH_AT"].partition(":")
armed_by = os.environ.get("ESPN_TEST_CRASH_ARMED_BY")
left = [int(count or 1)]


def checkpoint(name: str) -> None:
    if name == step and (armed_by is None or os.path.exists(armed_by)):
        left[0] -= 1
        if left[0] == 0:
            os.kill(os.getpid(), signal.SIGKILL)


crash_points._checkpoint = checkpoint
sys.exit(main(sys.argv[1:]))
