"""Writing a live index: the writer, staging and recovery, group commit, compaction, snapshots, replication."""
