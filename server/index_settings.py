"""The settings of the indexes a server holds besides its default one: `--index`, the index root,
the models indexes may be created with, idle close and the memory budget.

`IndexSettings` is a base of server.settings.ServerSettings (its fields are `ESPN_*` variables
and `espn serve` flags like every other), kept here with the rules that read them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from espn.engine import RULES

from .index_names import is_index_name, resolve_index_ram, resolve_models, split_entries

__all__ = ["IndexSettings"]


class IndexSettings(BaseModel):
    """The multi-index part of ServerSettings (see the module doc)."""

    indexes: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="more indexes, each served under /v1/indexes/NAME/...: NAME=PATH, or PATH (the default index), "
                    "or a directory whose subdirectories are indexes (each named after its subdirectory); "
                    "JSON list or comma-separated")
    index_idle_close_s: float = Field(0.0, ge=0.0, le=7 * 86400.0,
                                      description="close an index other than the default after this many seconds "
                                                  "without a request (it opens again on the next one); 0: never")
    index_root: Optional[Path] = Field(
        None, description="directory of indexes where POST /v1/indexes creates indexes (and DELETE removes them); "
                          "its indexes are served, each named after its subdirectory; created if missing; unset: the "
                          "--index given as a directory of indexes, if exactly one; neither: creating and deleting "
                          "indexes over HTTP is off")
    models: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="encoders POST /v1/indexes may create an index with, each NAME=SPEC, SPEC an encoder as "
                    "`espn index --encoder` takes it (e.g. small=minilm); JSON list or comma-separated")
    index_memory_budget_mib: float = Field(
        0.0, ge=0.0, le=float(1 << 30),
        description="estimated memory (MiB) the open indexes may hold per worker: before an index opens, idle "
                    "indexes are closed least recently used first to make room, else the request gets 503; the "
                    "estimate of an index is its RAM plan (--ram-mib): the files its searches map (all but "
                    "embeddings.bin, docs.jsonl and encoder/) and its record cache; 0: no budget")

    index_ram_mib: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="RAM (MiB) of one index, NAME=MIB (NAME as --index names it, `default` for INDEX), instead "
                    "of --ram-mib; JSON list or comma-separated")

    @field_validator("indexes", "models", "index_ram_mib", mode="before")
    @classmethod
    def _split_entries(cls, value: Any) -> Any:
        return split_entries(value)

    @field_validator("index_ram_mib")
    @classmethod
    def _check_index_ram(cls, value: list[str]) -> list[str]:
        resolve_index_ram(value)
        return value

    def index_ram_map(self) -> dict[str, float]:
        """The RAM (MiB) of each index an `--index-ram NAME=MIB` names, by name (instead of --ram-mib)."""
        return resolve_index_ram(self.index_ram_mib)

    @field_validator("index_root")
    @classmethod
    def _check_index_root(cls, value: Optional[Path]) -> Optional[Path]:
        if value is None:
            return None
        value = value.expanduser().resolve()
        if value.exists() and not value.is_dir():
            raise ValueError(f"{value} is not a directory")
        return value

    @model_validator(mode="after")
    def _check_models(self) -> "IndexSettings":
        resolve_models(self.models)
        return self

    def model_map(self) -> dict[str, str]:
        """The encoders indexes may be created with (`--model NAME=SPEC`), by name."""
        return resolve_models(self.models)

    def creation_root(self) -> Optional[Path]:
        """Where POST /v1/indexes creates indexes: --index-root, else the one --index DIR of indexes."""
        if self.index_root is not None:
            return self.index_root
        roots = []
        for entry in self.indexes:
            name, sep, _ = entry.partition("=")
            path = Path(entry).expanduser().resolve()
            if not (sep and is_index_name(name)) and path.is_dir() and not RULES.is_index_directory(path):
                roots.append(path)
        return roots[0] if len(roots) == 1 else None
