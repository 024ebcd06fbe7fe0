"""When a prefetch wave pays: a cost model fed by what the process measures as it serves.

A wave submits, from the scanning thread itself, the reads of the candidates that entered
the top `prefetch_k` since the last wave (`PendingRead.submit`: the read engine has them in
flight when the call returns); the search reaps them after the scan, on the same thread.
What a wave can win is the part of its reads that the scan still to come hides; what it
costs is its submission on the scanning thread, and the reads of candidates that drop out
of the final list (they hold the device while the reads that matter wait, which is what
counts where the device's bandwidth is the limit). So a wave is taken only when

    min(scan left, its read time) x useful share  -  submission  -  wasted reads  >=  min_gain_ms

with every term measured online, as exponentially weighted means:

- scan left: this search's own scan rate so far (its index, batch, and the CPU it gets:
  contention slows the scan and the estimate with it) times the codes left to scan;
- read time: bytes per millisecond of the searches' own critical-path reads (those not
  overlapped by waves), so a slow or busy device counts as slow;
- submission: the wall time the scanning thread spent in each wave's `submit` (planning
  and handing the extents to the engine; on a contended CPU it grows);
- useful share: of the documents the waves read, the share that made the final list.

On a tiny scan (a small index, or late in the scan) the hidden time is too small and the
wave is skipped; where the device's bandwidth, not its latency, limits the reads (SciFact's
1 MB per query on a virtio disk), the wasted reads outweigh what a short scan hides and the
prefetcher steps aside. Until a quantity has been measured its term is left out (the first
searches take waves whenever the scan left exceeds `min_gain_ms`, as the simpler model did).
"""

from __future__ import annotations

import dataclasses
import threading

__all__ = ["PrefetchModel", "PrefetchEstimates"]

#: Weight of the newest observation in each running mean.
ALPHA = 0.1


@dataclasses.dataclass(frozen=True)
class PrefetchEstimates:
    """The model's current estimates (None: not measured yet)."""

    read_bytes_per_ms: float | None
    submit_ms: float | None
    useful_share: float | None


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


class PrefetchModel:
    """Online estimates behind the wave decision; one per Searcher, shared by its threads."""

    def __init__(self, min_gain_ms: float = 0.2) -> None:
        self.min_gain_ms = float(min_gain_ms)
        self._lock = threading.Lock()
        self._bytes_per_ms: float | None = None
        self._submit_ms: float | None = None
        self._useful: float | None = None

    @property
    def estimates(self) -> PrefetchEstimates:
        return PrefetchEstimates(self._bytes_per_ms, self._submit_ms, self._useful)

    def may_pay(self, scan_left_ms: float) -> bool:
        """False when no wave could pay with `scan_left_ms` of scan to hide it (checked before the
        wave's candidates are even collected, so a tiny scan pays nothing for the question)."""
        return self.min_gain_ms == 0 or scan_left_ms - (self._submit_ms or 0.0) >= self.min_gain_ms

    def wave_pays(self, scan_left_ms: float, wave_bytes: int) -> bool:
        """Whether a wave reading `wave_bytes` (record bytes) pays, with `scan_left_ms` to hide it."""
        if self.min_gain_ms == 0:
            return True
        bpm, submit, useful = self._bytes_per_ms, self._submit_ms, self._useful
        read_ms = wave_bytes / bpm if bpm else float("inf")
        share = 1.0 if useful is None else useful
        wasted = (1 - share) * read_ms if bpm else 0.0
        gain = min(scan_left_ms, read_ms) * share - (submit or 0.0) - wasted
        return gain >= self.min_gain_ms

    def observe_read(self, record_bytes: int, ms: float) -> None:
        """A read on the critical path, not overlapped by waves: its record bytes and wall time."""
        if record_bytes > 0 and ms > 0:
            with self._lock:
                self._bytes_per_ms = _mix(self._bytes_per_ms, record_bytes / ms)

    def observe_submit(self, ms: float) -> None:
        """Wall time the scanning thread spent submitting one wave."""
        with self._lock:
            self._submit_ms = _mix(self._submit_ms, ms)

    def observe_usefulness(self, prefetched: int, useful: int) -> None:
        """Of `prefetched` (query, document) pairs the waves read, `useful` made the final list."""
        if prefetched > 0:
            with self._lock:
                self._useful = _mix(self._useful, useful / prefetched)
