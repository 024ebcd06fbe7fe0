"""`espn serve` with one of the library's existing test hooks set from the environment.

ESPN_TEST_BUG_FILE=PATH: while PATH exists, every read of the embedding store fails with a
plain ValueError (an internal bug, not a refusal of the query), through the store's fault
injector (`espn.store.engines.inject_faults`).
ESPN_TEST_PAUSE_AT=STEP:SECONDS:MARKER: the first time a writer or a compaction reaches the
checkpoint STEP (espn.files.crash_points.checkpoint), MARKER is created and the thread sleeps SECONDS.

Run with --workers 1, so the server is this process. Used by tests/test_serving_trust.py.
"""

import os
import sys
import time
from pathlib import Path

import espn.files.crash_points
from espn.cli import main
from espn.store.engines import FaultInjector, inject_faults


class InjectedBug(FaultInjector):
    def __init__(self, armed: Path) -> None:
        self.armed = armed

    def _fail(self) -> None:
        if self.armed.exists():
            raise ValueError("injected internal error (tests/fault_serve.py)")

    def syscall(self, name: str) -> int:
        self._fail()
        return 0

    def point(self, name: str) -> None:
        self._fail()


if os.environ.get("ESPN_TEST_PAUSE_AT"):
    step, seconds, marker = os.environ["ESPN_TEST_PAUSE_AT"].split(":", 2)
    paused = []

    def checkpoint(name: str) -> None:
        if name == step and not paused:
            paused.append(name)
            Path(marker).touch()
            time.sleep(float(seconds))  # the pause injected at that step (the marker says it began)

    espn.files.crash_points._checkpoint = checkpoint

if os.environ.get("ESPN_TEST_BUG_FILE"):
    with inject_faults(InjectedBug(Path(os.environ["ESPN_TEST_BUG_FILE"]))):
        sys.exit(main(sys.argv[1:]))
sys.exit(main(sys.argv[1:]))
