"""The compiled MaxSim kernel (`espn/native/maxsim.c`), loaded with ctypes.

`pip install` builds it with the system C compiler as the optional extension
`espn._maxsim` (no Python headers: it is a plain shared library, and ctypes releases the
GIL for the call). Where it was not built (no compiler) `load_kernel()` is None and
`espn.maxsim.score_records` scores with torch, to the same results (fp32 summation order
aside). One call scores every pair of a search from the records where the reads left
them: no gather, no decode, no similarity matrix in memory. A search with enough pairs is
cut into contiguous ranges scored at once on several threads (`threads`: the process's torch
thread budget), each range by its own call into the kernel with its own scratch: the
kernel is single-threaded, and MaxSim is most of a search's time once the records are read.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .errors import IndexCorruptError

if TYPE_CHECKING:
    from .store.residual import ResidualCodec

__all__ = ["load_kernel", "kernel_path", "score_pairs_native", "centroid_estimate_native", "DTYPE_CODES"]

log = logging.getLogger(__name__)

#: The kernel's code for each storage dtype.
DTYPE_CODES = {"float16": 0, "int8": 1, "residual2": 2, "residual4": 2}
#: Query vectors are laid out in columns of this many (the kernel's column block).
LANES = 16
#: Document vectors per register tile of the kernel: the scratch holds this many rows past
#: the longest document.
TILE_ROWS = 6
#: Fewest pairs a thread is given: a pair takes 10-30 µs, a hand-off to a pool thread about 50.
MIN_PAIRS_PER_THREAD = 16

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


def kernel_path() -> Path | None:
    """The built library beside this module, or None."""
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_maxsim{suffix}"
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=None)
def load_kernel() -> ctypes.CDLL | None:
    """The kernel, or None (logged once) where it was not built."""
    path = kernel_path()
    if path is None:
        log.info("the native MaxSim kernel was not built (no C compiler at install?); scoring with torch")
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("cannot load the native MaxSim kernel %s (%s); scoring with torch", path, exc)
        return None
    fn = lib.espn_score_pairs
    fn.restype = ctypes.c_int
    fn.argtypes = [_P, _P, _I64, _I64, ctypes.c_int, _P, _P, _P, _I64, _P, _P, _I64, _P, _P, _P,
                   _P, _I64, _P, ctypes.c_int, ctypes.c_int]
    estimate = getattr(lib, "espn_centroid_estimate", None)
    if estimate is not None:
        estimate.restype = _I64
        estimate.argtypes = [_I64, _P, _P, _I64, _I64, _I64, _P, _P, _P, _I64, _P, _P, _P, _I64]
    return lib


def _ptr(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


_pool_lock = threading.Lock()
_pool: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, pool)


def _helpers(workers: int) -> ThreadPoolExecutor:
    """This process's pool of kernel threads, `workers` at least (made again after a fork)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid() or _pool[1] < workers:
            _pool = (os.getpid(), workers, ThreadPoolExecutor(workers, thread_name_prefix="espn-maxsim"))
        return _pool[2]


def score_pairs_native(lib: ctypes.CDLL, addresses: np.ndarray, n_bow: np.ndarray, d_cls: int, d_bow: int,
                       dtype: str, q_cls: np.ndarray, q_bow_t: np.ndarray, q_valid: np.ndarray,
                       pair_query: np.ndarray, pair_doc: np.ndarray,
                       codec: ResidualCodec | None = None, threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(exact CLS [P], raw MaxSim sum [P]) float32 of the pairs, read from the records at `addresses`.

    addresses, n_bow [n] int64 (the records must stay alive during the call); q_cls [B, d_cls]
    float32; q_bow_t [B, d_bow, S] float32 (S a multiple of LANES, zero past each query's
    vectors); q_valid [B, S] uint8; pair_query, pair_doc [P] int64 (rows of `addresses`);
    threads: at most this many ranges of pairs scored at once (this thread scores the first).
    """
    arrays = [np.ascontiguousarray(a, dtype=t) for a, t in (
        (addresses, np.int64), (n_bow, np.int64), (q_cls, np.float32), (q_bow_t, np.float32),
        (q_valid, np.uint8), (pair_query, np.int64), (pair_doc, np.int64))]
    addresses, n_bow, q_cls, q_bow_t, q_valid, pair_query, pair_doc = arrays
    stride = int(q_bow_t.shape[2])
    n_pairs = len(pair_query)
    out_cls = np.empty(n_pairs, dtype=np.float32)
    out_bow = np.empty(n_pairs, dtype=np.float32)
    longest = int(n_bow.max()) if len(n_bow) else 0
    residual: tuple[int | None, int, int | None, int, int] = (None, 0, None, 0, 0)
    if codec is not None:
        centroids = np.ascontiguousarray(codec.centroids, dtype=np.float32)
        residual = (_ptr(centroids), len(centroids), _ptr(codec.byte_table), codec.bits, int(codec.normalize))

    def score(start: int, stop: int) -> int:
        """Pairs start:stop into out_cls and out_bow's same rows (views: the kernel sees their start)."""
        scratch = np.empty(stride + (longest + TILE_ROWS) * d_bow, dtype=np.float32)
        return int(lib.espn_score_pairs(_ptr(addresses), _ptr(n_bow), d_cls, d_bow, DTYPE_CODES[dtype], _ptr(q_cls),
                                        _ptr(q_bow_t), _ptr(q_valid), stride, _ptr(pair_query[start:stop]),
                                        _ptr(pair_doc[start:stop]), stop - start, _ptr(out_cls[start:stop]),
                                        _ptr(out_bow[start:stop]), _ptr(scratch), *residual))

    parts = max(1, min(int(threads), n_pairs // MIN_PAIRS_PER_THREAD))
    bounds = [n_pairs * i // parts for i in range(parts + 1)]
    others = [_helpers(parts - 1).submit(score, a, b) for a, b in zip(bounds[1:-1], bounds[2:])] if parts > 1 else []
    statuses = [score(bounds[0], bounds[1]), *(future.result() for future in others)]
    status = min(statuses)  # an error (negative) wins over success
    if status == -2:
        raise IndexCorruptError("a residual record names a centroid outside the codec (a damaged record)")
    if status != 0:
        raise ValueError(f"the MaxSim kernel refused its input (dtype {dtype!r}, stride {stride})")
    return out_cls, out_bow


def centroid_estimate_native(lib: ctypes.CDLL, parts: list[tuple[np.ndarray, np.ndarray]], n_centroids: int,
                             nearest: np.ndarray, gains: np.ndarray, allowed: np.ndarray | None,
                             n_docs: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The centroid estimate of one query (`espn/native/centroid_estimate.c`): the documents
    met (sorted) and their totals (float64), or None where the library predates the kernel.

    parts: each segment's postings (offsets [C + 1] int64, docs [nnz] int32); nearest [Lq, probe]
    int64 and gains [Lq, probe] float32, best first; allowed [n_docs] bool or None.
    """
    if getattr(lib, "espn_centroid_estimate", None) is None:
        return None
    parts = [(np.ascontiguousarray(o, dtype=np.int64), np.ascontiguousarray(d, dtype=np.int32)) for o, d in parts]
    nearest = np.ascontiguousarray(nearest, dtype=np.int64)
    gains = np.ascontiguousarray(gains, dtype=np.float32)
    flat = nearest.ravel()
    valid = flat[(flat >= 0) & (flat < n_centroids)]
    capacity = max(1, min(n_docs, sum(int((o[valid + 1] - o[valid]).sum()) for o, _ in parts)))
    mask = None if allowed is None else np.ascontiguousarray(allowed, dtype=np.uint8)
    stamp = np.zeros(n_docs, dtype=np.int32)  # zero pages: only what the lists touch is ever written
    totals = np.zeros(n_docs, dtype=np.float64)
    touched = np.empty(capacity, dtype=np.int64)
    offsets = (ctypes.c_void_p * len(parts))(*[_ptr(o) for o, _ in parts])
    docs = (ctypes.c_void_p * len(parts))(*[_ptr(d) for _, d in parts])
    count = lib.espn_centroid_estimate(len(parts), ctypes.cast(offsets, _P), ctypes.cast(docs, _P), n_centroids,
                                       nearest.shape[0], nearest.shape[1], _ptr(nearest), _ptr(gains),
                                       None if mask is None else _ptr(mask), n_docs, _ptr(stamp), _ptr(totals),
                                       _ptr(touched), capacity)
    if count == -2:
        raise ValueError("a centroid posting names a document outside the index")
    if count < 0:
        raise ValueError("the centroid estimate ran out of room (its capacity is computed above: a bug)")
    met = np.sort(touched[:count])
    return met, totals[met]

