"""Encode stage: corpus -> chunk files, tokenised in a DataLoader worker, the model in this process.

The worker process streams the corpus, cuts it into chunks, buckets each chunk's
documents by length (little padding) and tokenises them; the main process only
feeds the model and writes chunk files. Chunks that already exist are skipped, so
a re-run after a crash resumes, and `shard`/`num_shards` split chunks round-robin
between processes (one per GPU on a GPU machine).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import signal
from collections import deque
from itertools import chain, islice
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset
from tqdm import tqdm

from espn.corpus import PASSAGE_JOINER, CorpusDocument, iter_corpus, passage_text
from espn.encoders import Encoder
from espn.errors import CorpusError, EspnError
from espn.live.encoding import reorder_chunk

from .chunks import finished_chunks, write_chunk

__all__ = ["encode_corpus", "read_sample", "die_with_parent", "worker_death_is_one_line"]

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

log = logging.getLogger(__name__)


def read_sample(corpus: Path, count: int, skip_bad: bool, joiner: str = PASSAGE_JOINER) -> list[str]:
    """The first `count` documents' text (title and text joined by `joiner`): the sample a
    projection is fitted on (deterministic)."""
    return [passage_text(doc.title, doc.text, joiner) for doc in islice(iter_corpus(corpus, skip_bad=skip_bad), count)]


def die_with_parent(parent_pid: int, worker_id: int = 0) -> None:
    """DataLoader `worker_init_fn`: the kernel kills this worker when its parent dies, however it dies.

    Without it a `kill -9` of the build leaves the tokenising worker running (hundreds
    of MB, blocked on a queue nobody reads) and a resumed build starts another beside it.
    The parent may already be gone before prctl runs, so the parent pid is checked after.
    """
    del worker_id
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux/glibc: rely on the DataLoader's own watchdog
        log.debug("prctl(PR_SET_PDEATHSIG) unavailable")
    if os.getppid() != parent_pid:
        os._exit(1)


class ShardBatches(IterableDataset):
    """One shard's model batches of a corpus read in chunks, made in a loader worker: the text
    and page builds differ only in `records` and `batches`. The last item carries the corpus
    totals; an error comes back as an item, which the main process raises as one line instead
    of the DataLoader's "Caught ... in DataLoader worker" traceback."""

    def __init__(self, chunk_size: int, batch_size: int, shard: int, num_shards: int, done: frozenset[int]) -> None:
        self.chunk_size, self.batch_size = chunk_size, batch_size
        self.shard, self.num_shards, self.done = shard, num_shards, done

    def records(self) -> Iterator[Any]:
        """The corpus's records in order (documents, pages)."""
        raise NotImplementedError

    def batches(self, index: int, chunk: Iterator[Any]) -> Iterator[dict[str, Any]]:
        """The items of chunk `index` of this shard, from its records as they are read (at least
        one): one per model batch, the last with "last" true."""
        raise NotImplementedError

    def progress(self, total: int | None) -> tuple[int | None, int]:
        """(records this shard encodes in all, records already in finished chunks) for the bar,
        from the corpus's `total` records (None: unknown)."""
        if total is None:
            return None, 0
        mine = [c for c in range(-(-total // self.chunk_size)) if c % self.num_shards == self.shard]
        size = [min(self.chunk_size, total - c * self.chunk_size) for c in mine]
        return sum(size), sum(n for c, n in zip(mine, size) if c in self.done)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            yield from self._items()
        except EspnError as exc:
            yield {"error": str(exc), "kind": type(exc).__name__}

    def _items(self) -> Iterator[dict[str, Any]]:
        documents = chunks = 0
        records = self.records()
        for index in range(1 << 62):
            first = next(records, _END)
            if first is _END:
                break
            chunk = _Counted(chain([first], islice(records, self.chunk_size - 1)))
            if index % self.num_shards != self.shard or index in self.done:
                deque(chunk, maxlen=0)  # read (to keep the order), one record at a time, not encoded
            else:
                yield from self.batches(index, chunk)
                deque(chunk, maxlen=0)  # whatever `batches` left unread
            documents += chunk.count
            chunks = index + 1
        yield {"end": True, "documents": documents, "chunks": chunks}


_END = object()


class _Counted(Iterator[Any]):
    """An iterator that counts what it hands out."""

    def __init__(self, items: Iterator[Any]) -> None:
        self.items, self.count = items, 0

    def __next__(self) -> Any:
        item = next(self.items)
        self.count += 1
        return item


def end_totals(item: dict[str, Any]) -> dict[str, int] | None:
    """The corpus totals when `item` is a ShardBatches' last; raises the error an item carries."""
    if "error" in item:
        raise CorpusError(item["error"]) if item["kind"] == "CorpusError" else EspnError(item["error"])
    if item.get("end"):
        return {"documents": int(item["documents"]), "chunks": int(item["chunks"])}
    return None


class _TokenisedChunks(ShardBatches):
    """Passages tokenised in length-sorted batches."""

    def __init__(self, corpus: Path, encoder: Encoder, chunk_size: int, batch_size: int,
                 shard: int, num_shards: int, done: frozenset[int], skip_bad: bool,
                 joiner: str = PASSAGE_JOINER) -> None:
        super().__init__(chunk_size, batch_size, shard, num_shards, done)
        self.corpus, self.encoder, self.joiner, self.skip_bad = corpus, encoder, joiner, skip_bad

    def records(self) -> Iterator[CorpusDocument]:
        return iter_corpus(self.corpus, skip_bad=self.skip_bad)

    def batches(self, index: int, records: Iterator[CorpusDocument]) -> Iterator[dict[str, Any]]:
        chunk = list(records)  # a chunk of passages is bucketed by length as a whole
        texts = [passage_text(doc.title, doc.text, self.joiner) for doc in chunk]
        order = self.encoder.batch_order(texts)
        starts = range(0, len(order), self.batch_size)
        for number, start in enumerate(starts):
            rows = order[start : start + self.batch_size]
            yield {
                "chunk": index,
                "rows": np.asarray(rows, dtype=np.int64),
                "tokens": self.encoder.tokenize([texts[i] for i in rows], is_query=False),
                "last": number == len(starts) - 1,
                "meta": [(d.doc_id, d.title, d.text, d.metadata) for d in chunk] if number == 0 else None,
            }


def encode_corpus(corpus: Path, work_dir: Path, encoder: Encoder, *, chunk_size: int = 1024, batch_size: int = 32,
                  shard: int = 0, num_shards: int = 1, skip_bad: bool = False, loader_workers: int = 1,
                  progress: bool = True, total_documents: int | None = None,
                  joiner: str = PASSAGE_JOINER) -> dict[str, int]:
    """Write this shard's missing chunk files; returns {"documents": N, "chunks": C} of the whole corpus.

    total_documents (from the scan pass) gives the progress bar its total and ETA; joiner: what
    joins a title to its text in the passage the encoder reads (the index's, recorded in its manifest).
    """
    done = frozenset(finished_chunks(work_dir))
    dataset = _TokenisedChunks(corpus, encoder, chunk_size, batch_size, shard, num_shards, done, skip_bad, joiner)
    cuda = torch.cuda.is_available() and str(getattr(encoder, "device", "cpu")).startswith("cuda")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # fast tokenizers deadlock-warn after fork
    loader = DataLoader(dataset, batch_size=None, num_workers=loader_workers, pin_memory=cuda,
                        prefetch_factor=4 if loader_workers else None, persistent_workers=False,
                        worker_init_fn=functools.partial(die_with_parent, os.getpid()) if loader_workers else None)
    pending: dict[int, dict[str, Any]] = {}
    totals = {"documents": 0, "chunks": 0}
    total, initial = dataset.progress(total_documents)
    desc = "encode" if num_shards == 1 else f"encode shard {shard + 1} of {num_shards}"
    with tqdm(total=total, initial=initial, unit="doc", unit_scale=True, desc=desc, disable=not progress,
              mininterval=1.0) as bar, worker_death_is_one_line():
        for item in loader:
            end = end_totals(item)
            if end is not None:
                totals = end
                break
            state = pending.setdefault(int(item["chunk"]), {"parts": [], "meta": None})
            if item["meta"] is not None:
                state["meta"] = item["meta"]
            embeddings = encoder.embed_documents(item["tokens"])
            state["parts"].append((np.asarray(item["rows"]), embeddings))
            bar.update(len(item["rows"]))
            if item["last"]:
                index = int(item["chunk"])
                chunk = reorder_chunk(pending.pop(index)["parts"])
                ids, titles, texts, metadata = zip(*state["meta"])
                if len(chunk) != len(ids):
                    raise RuntimeError(f"chunk {index}: {len(chunk)} encoded documents for {len(ids)} ids")
                write_chunk(work_dir, index, chunk.cls, chunk.bow, chunk.counts, ids, titles, texts, metadata)
                log.debug("chunk %d written (%d documents)", index, len(ids))
    return totals


@contextlib.contextmanager
def worker_death_is_one_line() -> Iterator[None]:
    """A worker that died (OOM killer, kill) becomes one clear error.

    The DataLoader notices through SIGCHLD and raises RuntimeError wherever the main
    process happens to be (often inside the model), so the whole loop is covered.
    """
    try:
        yield
    except RuntimeError as exc:
        if "DataLoader worker" not in str(exc):
            raise
        reason = str(exc).split(". ")[0].rstrip(".")
        raise EspnError(_worker_died(reason)) from None
    except (EOFError, ConnectionResetError):
        # Killed while it was handing over a batch: the pipe ends before SIGCHLD is seen.
        raise EspnError(_worker_died("its pipe closed in the middle of a batch")) from None


def _worker_died(reason: str) -> str:
    return (f"the tokenising worker process died ({reason}); out of memory? "
            "try a smaller --chunk-size, or --loader-workers 0")
