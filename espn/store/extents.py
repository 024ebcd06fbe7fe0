"""Block planning for the direct-I/O readers (posix, kvikio): records -> few aligned reads."""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["ExtentPlan", "plan_extents", "DEFAULT_MAX_EXTENT_BYTES"]

#: Largest single read request the planners issue; adjacent blocks beyond it are split
#: into several requests so that many of them can be in flight at once.
DEFAULT_MAX_EXTENT_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class ExtentPlan:
    """Which aligned byte ranges to read, and where each record lands in the buffer.

    The extents are laid end to end in one buffer of `nbytes` bytes in the order given,
    so a record that spans two extents (a coalesced run split at the size cap) is still
    contiguous in the buffer.

    file_offsets:   [m] int64, byte offset of each extent in the file (block-aligned)
    lengths:        [m] int64, byte length of each extent (whole blocks, <= the cap)
    buffer_offsets: [m] int64, where each extent goes in the buffer (exclusive cumsum)
    starts:         [n] int64, byte position of each requested record in the buffer
    nbytes:         total buffer size, sum(lengths)
    """

    file_offsets: np.ndarray
    lengths: np.ndarray
    buffer_offsets: np.ndarray
    starts: np.ndarray
    nbytes: int

    def __len__(self) -> int:
        return len(self.file_offsets)


def plan_extents(
    offsets: np.ndarray,
    lengths: np.ndarray,
    block_size: int,
    max_extent_bytes: int = DEFAULT_MAX_EXTENT_BYTES,
) -> ExtentPlan:
    """Coalesce the block ranges of the requested records into few aligned reads.

    offsets, lengths: [n] int64 byte offset and length of each record (any order,
    duplicates allowed). Each record needs blocks [offset // B, ceil((offset + length) / B));
    the ranges are sorted, and overlapping or adjacent ones merged into runs (so two
    records in one block, or consecutive documents, cost one request). Runs longer than
    `max_extent_bytes` (rounded down to whole blocks, at least one block) are split, so
    that a large request does not serialise behind one request. Vectorised: no Python
    loop over records.

    >>> p = plan_extents(np.array([0, 100, 4096, 12288]), np.array([100, 50, 10, 10]), 4096)
    >>> p.file_offsets.tolist(), p.lengths.tolist(), p.starts.tolist()
    ([0, 12288], [8192, 4096], [0, 100, 4096, 8192])
    """
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if offsets.shape != lengths.shape:
        raise ValueError(f"offsets and lengths differ in shape: {offsets.shape} vs {lengths.shape}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    empty = np.zeros(0, dtype=np.int64)
    n = len(offsets)
    if n == 0:
        return ExtentPlan(empty, empty, empty, empty, 0)

    bsz = int(block_size)
    first = offsets // bsz
    # ceil division; a zero-length record still gets its block so that `starts` is valid.
    end = np.maximum(-(-(offsets + lengths) // bsz), first + 1)

    order = np.argsort(first, kind="stable")
    f_sorted, e_sorted = first[order], end[order]
    reach = np.maximum.accumulate(e_sorted)  # furthest block covered so far
    new_run = np.ones(n, dtype=bool)
    new_run[1:] = f_sorted[1:] > reach[:-1]  # equal means adjacent: merge
    run_starts_idx = np.flatnonzero(new_run)
    run_first = f_sorted[run_starts_idx]
    run_end = reach[np.append(run_starts_idx[1:] - 1, n - 1)]
    run_blocks = run_end - run_first
    run_buf = np.zeros(len(run_first), dtype=np.int64)
    np.cumsum(run_blocks[:-1] * bsz, out=run_buf[1:])

    run_of_doc = np.empty(n, dtype=np.int64)
    run_of_doc[order] = np.cumsum(new_run) - 1
    starts = run_buf[run_of_doc] + offsets - run_first[run_of_doc] * bsz

    # Split runs into extents of at most `cap` blocks; they stay contiguous in the buffer.
    cap = max(1, int(max_extent_bytes) // bsz)
    n_chunks = -(-run_blocks // cap)
    ext_run = np.repeat(np.arange(len(run_first)), n_chunks)
    chunk = np.arange(int(n_chunks.sum())) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
    ext_first = run_first[ext_run] + chunk * cap
    ext_blocks = np.minimum(cap, run_end[ext_run] - ext_first)
    ext_lengths = ext_blocks * bsz
    ext_buf = run_buf[ext_run] + chunk * cap * bsz
    return ExtentPlan(
        file_offsets=ext_first * bsz,
        lengths=ext_lengths,
        buffer_offsets=ext_buf,
        starts=starts,
        nbytes=int(run_blocks.sum()) * bsz,
    )
