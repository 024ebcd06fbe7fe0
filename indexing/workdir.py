"""The build's work directory `OUT.partial/`: chunk files, the fitted encoder, shard markers.

It lives next to `--out` so the finished index can appear there by `os.replace`
(same filesystem). A `job.json` fingerprint ties it to one corpus and one set of
encoding options: re-running the same command resumes, a different one starts over.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Iterator

from espn.files.durable import write_json_atomic

__all__ = ["WorkDir"]

log = logging.getLogger(__name__)


class WorkDir:
    def __init__(self, out: Path) -> None:
        out = Path(out).absolute()
        self.out = out
        self.path = out.with_name(out.name + ".partial")

    @property
    def encoder_dir(self) -> Path:
        return self.path / "encoder"

    @property
    def job_file(self) -> Path:
        return self.path / "job.json"

    def marker(self, shard: int, num_shards: int) -> Path:
        (self.path / "shards").mkdir(parents=True, exist_ok=True)
        return self.path / "shards" / f"{shard}-of-{num_shards}.json"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Serialise set-up between shard processes that share this directory."""
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def claim(self, job: dict[str, Any]) -> bool:
        """Bind the directory to `job`; returns True when resuming earlier work. Call under `locked`."""
        if self.job_file.is_file():
            try:
                previous = json.loads(self.job_file.read_text())
            except json.JSONDecodeError:
                previous = None
            if isinstance(previous, dict) and {key: previous.get(key) for key in job} == job:
                return True
            log.warning("%s belongs to a different build (corpus or options changed); starting over", self.path)
            for child in self.path.iterdir():
                if child.name != "lock":
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
        self.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.job_file, job)
        return False

    def job(self) -> dict[str, Any]:
        if not self.job_file.is_file():
            raise FileNotFoundError(f"{self.path}: no build in progress for {self.out} (run `espn index` first)")
        return json.loads(self.job_file.read_text())

    def markers(self) -> list[dict[str, Any]]:
        folder = self.path / "shards"
        return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
