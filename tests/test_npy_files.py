"""espn.mapped: every `.npy` espn reads, mapped or whole, with its header parsed under one lock."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from espn.mapped import map_npy, read_npy


@pytest.mark.parametrize("array", [np.arange(12, dtype=np.float32).reshape(3, 4),
                                   np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4)),
                                   np.array([b"a", b"bcd"], dtype="S3"),
                                   np.zeros((0, 7), np.float16)], ids=["c", "fortran", "bytes", "empty"])
def test_read_and_map_give_what_numpy_saved(tmp_path: Path, array: np.ndarray) -> None:
    path = tmp_path / "a.npy"
    np.save(path, array)
    whole, mapped = read_npy(path), map_npy(path)
    for got in (whole, mapped):
        assert got.dtype == array.dtype and got.shape == array.shape and np.array_equal(got, array)
    whole[...] = 0  # read whole: the caller's own copy
    assert np.array_equal(map_npy(path), array)


def test_an_object_array_or_a_short_file_is_refused(tmp_path: Path) -> None:
    objects = tmp_path / "objects.npy"
    np.save(objects, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    short = tmp_path / "short.npy"
    np.save(short, np.arange(100, dtype=np.int64))
    short.write_bytes(short.read_bytes()[:-8])
    for read in (read_npy, map_npy):
        with pytest.raises(ValueError, match="object array"):
            read(objects)
        with pytest.raises(ValueError, match="the header describes"):
            read(short)


class _Garbage:
    """A reference cycle whose finalizer lets another thread run, then leaves a new cycle behind:
    there is always garbage for the next collection, and a collection that lands in the middle of a
    header parse switches threads there, as a busy server's garbage does now and then."""

    renew = True

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        time.sleep(0)
        if _Garbage.renew:
            _Garbage()


def test_headers_parsed_in_many_threads_at_once_never_fail(tmp_path: Path) -> None:
    """numpy parses a header with ast.literal_eval; CPython 3.11 counts the AST builder's depth per
    interpreter, so two threads parsing at once could raise "SystemError: AST constructor recursion
    depth mismatch" (cpython gh-106905; seen in CI when two snapshots verified their copies at
    once). With the lock removed from espn.mapped._header, 62-68 of these 6,000 reads failed here
    (three runs)."""
    path = tmp_path / "small.npy"
    np.save(path, np.arange(12, dtype=np.float32).reshape(3, 4))
    failures: list[BaseException] = []
    start = threading.Barrier(4)

    def read_many() -> None:
        start.wait()
        for i in range(1500):
            try:
                (read_npy if i % 2 else map_npy)(path)
            except BaseException as exc:  # noqa: BLE001 - collected and asserted on below
                failures.append(exc)

    threshold = gc.get_threshold()
    gc.set_threshold(3, 1, 1)  # collect often, so a collection lands inside a parse
    _Garbage.renew = True
    for _ in range(4):
        _Garbage()
    try:
        threads = [threading.Thread(target=read_many) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        _Garbage.renew = False
        gc.set_threshold(*threshold)
        gc.collect()
    assert not failures, (len(failures), failures[:3])
