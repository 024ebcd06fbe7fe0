"""Replication to object storage (S3-compatible): publish, follow, restore, retention; fenced
writers (a lease, conditional writes), the shard map and resharding."""
