"""When a prefetch wave pays: a cost model fed by what the process measures as it serves.

A wave submits, from the scanning thread itself, the reads of the candidates that entered
the top `prefetch_k` since the last wave (`PendingRead.submit`: the read engine has them in
flight when the call returns); the search reaps them after the scan, on the same thread.
Without waves the final candidates are read after the scan: a submission, then the
device's time for all of them, T(all). With a wave, its documents are in flight during the
scan still to come; after the scan the misses are submitted and the search waits for
whichever ends last: the wave's reads (T(wave) less the scan left) or the misses' own
round trip T(misses), paid by the searches that have misses at all. A device whose time is
mostly latency (a virtio disk: 10 reads take nearly as long as 100) therefore gains only
where the waves leave no misses. Against the time saved stand the wave's own costs: its
call, the submission of documents that drop out of the final list, and the CPU its reads
take from the scan itself (the kernel's completion work lands on the scan's cores, which
on a loaded machine means on the scan). A wave is taken when

    T(all) - E[max(T(wave) - scan left, T(misses))] - call - wasted submission - slowdown  >=  min_gain_ms

with every term measured online, as exponentially weighted means:

- scan left: this search's own scan rate so far times the codes left to scan;
- T(bytes) = latency + bytes / bandwidth, fitted to the searches' critical-path reads: all
  final candidates where no wave ran (one search in `EXPLORE_EVERY` takes none, so large
  reads keep being measured while waves are taken), the misses where waves ran (small
  reads; a wave's tail still in flight makes them look slower, which errs towards
  stepping aside);
- call and submission: the wall time of `submit`, fitted as a cost per call plus a cost per
  document over every submission (waves and misses);
- slowdown: how much longer the scan took per wave document than its rate before the wave
  predicted (interference: CPU available to the scan);
- the useful share of wave documents, and how often and how much the waves missed.

On a tiny scan (a small index, or late in the scan) nothing is hidden and the wave is
skipped at once (`may_pay`); under CPU contention the submission and the slowdown grow
and the prefetcher steps aside. Until a quantity has been measured its term is left out.

Over all of that sits a check of the outcome itself (`may_wave`, `observe_outcome`): the
time from the scan's start to the last read, per query, of the searches that followed the
model and of those that read plainly (one in `EXPLORE_EVERY`, chosen by count, so both
see the same queries). The terms above can each be right and their sum still wrong: on the
2-vCPU VM, 2 M documents, a process whose model took waves (hit rate 0.84) searched at
11.0 ms p50 against 8.6 ms without prefetch. When the model's searches are slower than the
plain ones by more than `OUTCOME_MARGIN`, waves stop and only one search in `EXPLORE_EVERY`
follows the model, to notice when waves pay again.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np

__all__ = ["PrefetchModel", "PrefetchEstimates", "ScanProgress", "segment_codes"]

#: Weight of the newest observation in each running mean.
ALPHA = 0.1
#: One search in this many takes the other arm: no waves while waves pay (the read model
#: keeps seeing plain reads), the model's waves while they do not (to see if they pay again).
EXPLORE_EVERY = 16
#: Searches of each arm before the outcome check judges.
MIN_OUTCOMES = 8
#: Waves stop when the model's searches take this share longer than plain ones, and resume
#: when they take this share less.
OUTCOME_MARGIN = 0.03


@dataclasses.dataclass(frozen=True)
class PrefetchEstimates:
    """The model's current estimates (None: not measured yet)."""

    read_latency_ms: float | None
    read_ms_per_mb: float | None
    call_ms: float | None
    submit_ms_per_doc: float | None
    slowdown_ms_per_doc: float | None
    useful_share: float | None
    miss_share: float | None  # of the searches that took waves, those left with misses
    miss_bytes: float | None  # record bytes those missed
    waves_pay: bool  # the outcome check: the model's searches are not slower than plain ones
    outcome_ms: tuple[float | None, float | None]  # scan start to last read per query: (model, plain)


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


class _Line:
    """y = a + b·x fitted by exponentially weighted least squares (a, b >= 0)."""

    def __init__(self) -> None:
        self.x: float | None = None
        self.y: float | None = None
        self.xx: float | None = None
        self.xy: float | None = None

    def add(self, x: float, y: float) -> None:
        self.x, self.y = _mix(self.x, x), _mix(self.y, y)
        self.xx, self.xy = _mix(self.xx, x * x), _mix(self.xy, x * y)

    def fit(self) -> tuple[float, float] | None:
        if self.x is None or self.y is None or self.xx is None or self.xy is None:
            return None
        var = self.xx - self.x * self.x
        if var <= 1e-6 * max(1.0, self.xx):  # one size only: charge it all per unit
            return 0.0, self.y / self.x if self.x > 0 else 0.0
        b = max(0.0, (self.xy - self.x * self.y) / var)
        return max(0.0, self.y - b * self.x), b


class PrefetchModel:
    """Online estimates behind the wave decision; one per Searcher, shared by its threads."""

    def __init__(self, min_gain_ms: float = 0.2) -> None:
        self.min_gain_ms = float(min_gain_ms)
        self._lock = threading.Lock()
        self._read = _Line()  # ms of a plain read against its record bytes
        self._submit = _Line()  # ms of a submit call against its documents
        self._slowdown: float | None = None  # ms of scan lost per wave document
        self._useful: float | None = None
        self._miss_share: float | None = None
        self._miss_bytes: float | None = None
        self._searches = 0
        self._outcome: dict[bool, float | None] = {True: None, False: None}  # by "followed the model"
        self._outcomes = {True: 0, False: 0}
        self._waves_pay = True

    @property
    def estimates(self) -> PrefetchEstimates:
        read, submit = self._read.fit(), self._submit.fit()
        return PrefetchEstimates(read and read[0], read and read[1] * 1e6, submit and submit[0],
                                 submit and submit[1], self._slowdown, self._useful, self._miss_share,
                                 self._miss_bytes, self._waves_pay, (self._outcome[True], self._outcome[False]))

    @property
    def waves_pay(self) -> bool:
        """The outcome check's verdict: False while the model's searches are slower than plain ones."""
        return self._waves_pay

    def may_wave(self) -> bool:
        """Whether this search follows the model (which may take waves) or reads plainly: the
        outcome check's arm, and the other arm for one search in EXPLORE_EVERY."""
        with self._lock:
            self._searches += 1
            if self.min_gain_ms == 0:  # every wave, always (min_gain_ms = 0: no model at all)
                return True
            return (self._searches % EXPLORE_EVERY == 0) != self._waves_pay

    def observe_outcome(self, followed_model: bool, ms_per_query: float) -> None:
        """A search's time from the start of its scan to its last read, per query, and its arm."""
        with self._lock:
            self._outcome[followed_model] = _mix(self._outcome[followed_model], ms_per_query)
            self._outcomes[followed_model] += 1
            model, plain = self._outcome[True], self._outcome[False]
            if model is None or plain is None or min(self._outcomes.values()) < MIN_OUTCOMES:
                return
            if self._waves_pay and model > plain * (1 + OUTCOME_MARGIN):
                self._waves_pay = False
            elif not self._waves_pay and model * (1 + OUTCOME_MARGIN) < plain:
                self._waves_pay = True

    def may_pay(self, scan_left_ms: float) -> bool:
        """False when no wave could pay with `scan_left_ms` of scan to hide it (checked before the
        wave's candidates are even collected, so a tiny scan pays nothing for the question)."""
        fit = self._submit.fit()
        return self.min_gain_ms == 0 or scan_left_ms - (fit[0] if fit else 0.0) >= self.min_gain_ms

    def expected_gain_ms(self, scan_left_ms: float, wave_docs: int, wave_bytes: int) -> float:
        """What a wave of `wave_docs` documents (`wave_bytes` record bytes) is expected to save."""
        useful = 1.0 if self._useful is None else self._useful
        call, per_doc = self._submit.fit() or (0.0, 0.0)
        cost = call + (1 - useful) * per_doc * wave_docs + (self._slowdown or 0.0) * wave_docs
        read = self._read.fit()
        if read is None:  # no read measured yet: the scan left bounds what can be hidden
            return scan_left_ms * useful - cost
        latency, per_byte = read
        miss_share, miss_bytes = self._miss_share or 0.0, self._miss_bytes or 0.0
        t_wave = latency + per_byte * wave_bytes
        t_all = latency + per_byte * (useful * wave_bytes + miss_share * miss_bytes)
        t_misses = latency + per_byte * miss_bytes
        tail = max(t_wave - scan_left_ms, 0.0)
        waited = miss_share * max(tail, t_misses) + (1 - miss_share) * tail
        return t_all - waited - cost

    def wave_pays(self, scan_left_ms: float, wave_docs: int, wave_bytes: int) -> bool:
        """Whether a wave of `wave_docs` documents (`wave_bytes` record bytes) pays, with
        `scan_left_ms` of scan to hide it."""
        return self.min_gain_ms == 0 or self.expected_gain_ms(scan_left_ms, wave_docs, wave_bytes) >= self.min_gain_ms

    def observe_read(self, record_bytes: int, ms: float) -> None:
        """A read on the critical path: its record bytes and the wall time from its submission
        until every read of the search was reaped."""
        if record_bytes > 0 and ms > 0:
            with self._lock:
                self._read.add(float(record_bytes), ms)

    def observe_submit(self, docs: int, ms: float) -> None:
        """Wall time the searching thread spent in one `submit` of `docs` documents."""
        if docs > 0:
            with self._lock:
                self._submit.add(float(docs), ms)

    def observe_slowdown(self, wave_docs: int, ms: float) -> None:
        """The scan after a wave of `wave_docs` documents took `ms` longer than its rate before it
        predicted (its submission excluded)."""
        if wave_docs > 0:
            with self._lock:
                self._slowdown = _mix(self._slowdown, max(0.0, ms) / wave_docs)

    def observe_waves(self, prefetched: int, useful: int, missed_bytes: int) -> None:
        """A search that took waves: of `prefetched` (query, document) pairs read, `useful` made
        the final list; `missed_bytes` record bytes were read after the scan."""
        if prefetched > 0:
            with self._lock:
                self._useful = _mix(self._useful, useful / prefetched)
                self._miss_share = _mix(self._miss_share, float(missed_bytes > 0))
                if missed_bytes > 0:
                    self._miss_bytes = _mix(self._miss_bytes, float(missed_bytes))


def segment_codes(lists: np.ndarray, sizes: np.ndarray, segments: list[tuple[int, int]]) -> np.ndarray:
    """[S] codes scanned by each segment [a, b) of the probed `lists` [B, nprobe] (-1: none)."""
    per_probe = np.where(lists >= 0, sizes[np.maximum(lists, 0)], 0).sum(axis=0)
    return np.array([per_probe[a:b].sum() for a, b in segments], dtype=np.int64)


class ScanProgress:
    """One search's scan over its segments of clusters: how much is left, at what pace, and
    what a wave did to that pace (the slowdown the model charges waves for).

    codes: [S] codes each segment scans (every query of the batch together).
    """

    def __init__(self, codes: np.ndarray) -> None:
        self._done = np.cumsum(np.asarray(codes, dtype=np.float64))
        self._total = float(self._done[-1]) if len(self._done) else 0.0
        self._start = time.perf_counter()
        self._first_wave: tuple[float, float, float] | None = None  # (ms per code before it, end of its submit, codes done)
        self._wave_docs = 0
        self._later_submits = 0.0  # seconds spent submitting later waves (not slowdown)

    def left_ms(self, segment: int) -> float:
        """The scan still to come after `segment`: the pace so far times the codes left."""
        done = self._done[segment]
        elapsed = (time.perf_counter() - self._start) * 1000
        return elapsed * (self._total - done) / done if done > 0 else 0.0

    def waved(self, segment: int, docs: int, submit_started: float, submit_ended: float) -> None:
        """A wave of `docs` documents was submitted after `segment` (perf_counter times)."""
        done = float(self._done[segment])
        if self._first_wave is None and done > 0:
            self._first_wave = ((submit_started - self._start) * 1000 / done, submit_ended, done)
        else:
            self._later_submits += submit_ended - submit_started
        self._wave_docs += docs

    def slowdown(self) -> tuple[int, float] | None:
        """At the end of the scan: (wave documents, ms the scan after the first wave took beyond
        its earlier pace, submissions excluded), or None without waves."""
        if self._first_wave is None:
            return None
        pace, since, done = self._first_wave
        actual = (time.perf_counter() - since - self._later_submits) * 1000
        return self._wave_docs, actual - pace * (self._total - done)
