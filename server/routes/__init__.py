"""One router per resource: search, documents, snapshots, and health (liveness, readiness, metrics)."""

from . import documents, health, search, snapshots

__all__ = ["documents", "health", "search", "snapshots"]
