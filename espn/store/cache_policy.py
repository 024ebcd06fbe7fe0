"""Which records the record cache keeps: a frequency sketch of what is asked for, and the
admission and eviction rules measured against each other (`benchmarks/bench_cache_policy.py`).

When a class of slots is full, each record just read is paired with the weakest of
`VICTIM_SAMPLES` residents sampled from its class (as Redis samples): the least frequently
asked for ("tinylfu"), or the least recently used ("lru", "tinylfu-lru"). "lru" always
admits; the TinyLFU rules admit a candidate only when the sketch says it was asked for more
often than the resident it would replace, so one scan of cold documents leaves the hot set
in place.
All of it is numpy over arrays that may live in a shared segment: no Python object per record.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidParameterError

__all__ = ["FrequencySketch", "POLICIES", "DEFAULT_POLICY", "VICTIM_SAMPLES", "DOORKEEPER", "MAX_CONTENDERS",
           "contenders", "pick_victims"]

#: Admission and eviction rules by name; DEFAULT_POLICY is the one the measurements chose.
POLICIES = ("tinylfu", "tinylfu-lru", "lru")
DEFAULT_POLICY = "tinylfu"
#: Residents sampled per admission candidate when a class is full.
VICTIM_SAMPLES = 4
#: With a class full, a candidate competes (TinyLFU rules) once asked for this many times ...
DOORKEEPER = 2
#: ... and at most this many candidates of one request compete.
MAX_CONTENDERS = 16


class FrequencySketch:
    """Count-min sketch of how often each key (doc number) was asked for, with aging.

    table: [depth, width] uint16 counters (width a power of two), zeros at first; added: [1]
    int64, the additions since the last reset (both may be views of shared memory: every
    process then counts into one sketch). Estimate = the minimum over the rows. Every
    `10 x width` additions all counters are halved (TinyLFU's reset), which keeps them well
    below 2^16 and lets the estimate follow a changing stream.
    """

    def __init__(self, table: np.ndarray, added: np.ndarray, seed: int = 0) -> None:
        depth, width = table.shape
        if width < 16 or width & (width - 1):
            raise InvalidParameterError(f"the sketch width must be a power of two >= 16, got {width}")
        self.width = int(width)
        self._shift = np.uint64(64 - self.width.bit_length() + 1)
        rng = np.random.default_rng(seed)
        # Odd multipliers: multiply-shift hashing of 64-bit keys (the same in every process).
        self._mul = np.asarray(rng.integers(1, 2**63, size=depth, dtype=np.uint64)) * np.uint64(2) + np.uint64(1)
        self._table = table
        self._added = added
        self._rows = np.arange(depth)[:, None]
        self.sample_size = 10 * self.width

    @staticmethod
    def width_for(entries: int) -> int:
        """The width for a cache of `entries` records: 4 counters a record, at least 1024."""
        return 1 << (max(1024, 4 * int(entries)) - 1).bit_length()

    @property
    def nbytes(self) -> int:
        return int(self._table.nbytes)

    def _slots(self, keys: np.ndarray) -> np.ndarray:
        """[depth, n] counter index of each key in each row."""
        k = np.asarray(keys, dtype=np.int64).astype(np.uint64)
        with np.errstate(over="ignore"):
            return ((k[None, :] * self._mul[:, None]) >> self._shift).astype(np.int64)

    def add(self, keys: np.ndarray) -> None:
        """Count one more request of each of `keys` ([n] int; repeats count each time)."""
        if len(keys) == 0:
            return
        slots = self._slots(keys) + self._rows * self.width  # counters of every row, in one flat index
        # Each counter once with its count (np.add.at, which takes repeats one by one, was 5x slower
        # on a request of 750 documents: 110 us against 21).
        counters, counts = np.unique(slots, return_counts=True)
        flat = self._table.reshape(-1)
        flat[counters] += counts.astype(flat.dtype)
        self._added[0] += len(keys)
        if self._added[0] >= self.sample_size:
            self._table >>= 1
            self._added[0] //= 2

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        """[n] int64 estimated request counts (never below the true count since the last reset)."""
        if len(keys) == 0:
            return np.zeros(0, dtype=np.int64)
        return self._table[self._rows, self._slots(keys)].min(axis=0).astype(np.int64)


def contenders(policy: str, candidate_freq: np.ndarray) -> np.ndarray:
    """Which candidates of full classes compete at all (indices, most frequent first): for the
    TinyLFU rules only those asked for at least DOORKEEPER times (a record asked for once cannot
    beat a resident worth keeping: its read is not worth the comparison, as TinyLFU's doorkeeper
    has it), and for every rule at most MAX_CONTENDERS per request, which bounds what a request
    whose misses are many pays to offer them."""
    order = np.argsort(-candidate_freq, kind="stable")
    if policy != "lru":
        order = order[candidate_freq[order] >= DOORKEEPER]
    return order[:MAX_CONTENDERS]


def pick_victims(policy: str, candidate_freq: np.ndarray, sample: np.ndarray, sample_freq: np.ndarray,
                 sample_stamp: np.ndarray, usable: np.ndarray) -> np.ndarray:
    """[n] the slot each candidate takes (-1: it stays out), for candidates of full classes.

    candidate_freq: [n] sketch estimates of the candidates; sample: [n, s] slots sampled from each
    candidate's class, with their residents' estimates, last-use ticks and whether they may be
    replaced at all (`usable`: no read in flight may be reading them). Each candidate is paired
    with the weakest usable slot of its sample (least frequent for "tinylfu", least recent for the
    others), enters by the policy's rule, and where two want one slot the more frequent wins.
    """
    weakness = np.where(usable, sample_freq if policy == "tinylfu" else sample_stamp, np.iinfo(np.int64).max)
    pick = np.argmin(weakness, axis=1)
    rows = np.arange(len(candidate_freq))
    victim = sample[rows, pick]
    wins = usable[rows, pick]
    if policy != "lru":
        wins &= candidate_freq > sample_freq[rows, pick]
    order = np.argsort(-candidate_freq, kind="stable")
    order = order[wins[order]]
    _, first = np.unique(victim[order], return_index=True)  # one candidate per slot: the most frequent
    out = np.full(len(candidate_freq), -1, dtype=np.int64)
    out[order[first]] = victim[order[first]]
    return out
