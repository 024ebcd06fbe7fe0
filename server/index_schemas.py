"""Request and response models of `/v1/indexes` (listed, created, deleted); server.schemas re-exports them."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["IndexInfo", "IndexListResponse", "CreateIndexRequest"]


class IndexInfo(BaseModel):
    """One index a server holds (GET /v1/indexes, /readyz)."""

    name: str = Field(description="its name: the index's routes are under /v1/indexes/{name}/")
    default: bool = Field(description="the default index, also served by /v1/search, /v1/documents, ...")
    open: bool = Field(description="open in the worker that answered (indexes open on their first request and "
                                   "close after ESPN_INDEX_IDLE_CLOSE_S without one)")
    documents: int = Field(description="documents searchable: now when open, else when it last closed (or as built)")
    generation: Optional[int] = Field(default=None, description="the live-index generation served, when open")
    encoder: str = Field(description="the encoder's kind and model name from the index's manifest, e.g. hf:all-MiniLM-L6-v2")
    mode: Optional[str] = Field(default=None, description='"read-write" or "read-only", when open')
    fit: Optional[dict[str, Any]] = Field(
        default=None, description="what the index is fitted on: exact (searched exactly while small), "
                                  "fitted_on_documents, fitted_at, added_since_fit, growth_since_fit, and "
                                  "refit_running (kind, documents written of how many, since when; null: none runs)")
    memory_mib: Optional[float] = Field(
        default=None, description="estimated memory the index holds when open (MiB; what --index-memory-budget "
                                  "counts): the size of the files its searches map, all but embeddings.bin, "
                                  "docs.jsonl and encoder/ (one model per encoder, shared)")


class IndexListResponse(BaseModel):
    """GET /v1/indexes."""

    indexes: list[IndexInfo] = Field(description="every index this server holds, the default first")


class CreateIndexRequest(BaseModel):
    """POST /v1/indexes: a new, empty index."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=64,
                      description="its name (letters, digits, '_', '.', '-'; not first '.', '_' or '-'): its routes "
                                  "will be under /v1/indexes/{name}/")
    model: str = Field(min_length=1, max_length=64,
                       description="the encoder, by the name the server was configured with (`espn serve --model "
                                   "NAME=SPEC`); a 422 lists the configured ones")
