"""Writing a live index: the writer, staging and recovery, group commit, compaction, snapshots,
replication to object storage (espn.live.replication).

Import from the modules (`from espn.live.live_index import LiveIndex`, `from espn.live.checks
import NewDocument`): this package imports nothing itself, so `espn.cli` can register the
live-index commands (espn.live.parsers) without loading FAISS before logging is set up.

  checks.py        what a write is (NewDocument, WriteRequest, WriteResult, WriteLimits) and check_write
  encoding.py      documents encoded in memory (EncodedDocuments), shared with the offline build
  resolve.py       a group of writes resolved in order against the current generation
  segment_files.py the files one publish writes: a delta segment, a tombstone file
  side_index.py    the protocol of an index kept beside the vectors (SideIndex), injected into the writer
  staging.py       staging directories, crash recovery, garbage collection of live/
  status.py        live_stats, fit_status, read_only_reason (no lock)
  progress.py      a running compaction's progress, beside its lock
  writer.py        IndexWriter: the writer lock, encode, publish, commit
  text_side.py     the full-text index as a SideIndex
  merging.py       merging consecutive delta segments; the side indexes' part of a swap
  fitting.py       what a base is fitted on, and fit_base (every base: build, rewrite, re-fit, creation)
  rewrite.py       a compaction's base rewrite and its carry-over swap
  compaction.py    Plan, CompactionPolicy, run_compaction (takes a writer; the writer never imports it)
  live_index.py    LiveIndex: IndexWriter + the index's own side indexes + compaction and re-fit
  create.py        an index created empty (exact), and removing one from an index root
  commit.py        GroupCommit: writes that arrive together are published together
  snapshot.py      snapshots and restores of one generation
  replication/     object storage: publish, follow, restore, retention, fenced writers, the shard
                   map's store side, resharding
  parsers.py       the parsers of `espn create | delete | compact | refit | stats | snapshot | restore |
                   publish | shard-map | reshard`
  commands.py      their code (espn.cli runs it once logging is configured)
"""
