"""Replication to object storage (S3-compatible): publish, follow, restore, retention."""
