"""One router per resource: search, documents, and health (liveness, readiness, metrics)."""

from . import documents, health, search

__all__ = ["documents", "health", "search"]
