"""Creating and deleting indexes by name in a registry's root.

A created index is written empty there by espn.live.create (nothing trained: it is searched
exactly while small and fitted on its own documents as it grows) and moved into place by one
rename, in a fraction of a second: each configured model is loaded once, at its first
creation, and saved once in the root (`.espn-models/`), and every index created with it links
those files. A deleted index is renamed to a hidden tombstone there, then removed. Other
processes see either through the directory itself (espn.engine.registry). The default index,
and an index served from outside the root, cannot be deleted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConflictError, EspnError, IndexExistsError, IndexNotFoundError, InvalidParameterError, UnavailableError
from ..encoders import encoder_from_spec
from ..live.create import EncoderFiles, create_index as create_empty, encoder_template, remove_index
from .messages import Lifecycle
from .rules import RULES
from .served import ServedIndex

if TYPE_CHECKING:  # the registry calls these with itself
    from .registry import Registry

__all__ = ["create_index", "delete_index", "MAX_CONCURRENT_CREATIONS"]

logger = logging.getLogger(__name__)

#: Creations running at once in one process (each a fraction of a second once its model's files
#: are saved; the first of a model loads it): more are refused with 503 and Retry-After.
MAX_CONCURRENT_CREATIONS = 4


def _root(registry: "Registry", what: str) -> Path:
    if registry.config.index.read_only:
        raise ConflictError(f"this server is read-only (--read-only): it {what} no indexes", code="read_only")
    if registry.root is None:
        raise ConflictError(f"this server {what} no indexes: it has no index root (start it with --index-root DIR, "
                            "or --index DIR of indexes)", code="admin_off")
    return registry.root


async def create_index(registry: "Registry", name: str, model: str) -> ServedIndex:
    """The empty index `name`, made in the root with the configured model `model`, held closed."""
    root = _root(registry, "creates")
    problem = RULES.index_name_problem(name)
    if problem is not None:
        raise InvalidParameterError(problem, code="invalid_request")
    models = registry.config.models
    if not models:
        raise ConflictError("this server has no models to create indexes with: start it with --model NAME=SPEC "
                            "(e.g. --model small=minilm)", code="admin_off")
    spec = models.get(model)
    if spec is None:
        raise InvalidParameterError(f"no model named {model!r}; this server creates indexes with: "
                                    f"{', '.join(sorted(models))} (--model NAME=SPEC)", code="unknown_model")
    registry.refresh()
    if name in registry.held or name in registry.creating or (root / name).exists():
        raise ConflictError(f"an index named {name!r} exists (or is being created); DELETE it first or choose "
                            "another name", code="index_exists")
    if len(registry.creating) >= MAX_CONCURRENT_CREATIONS:
        raise UnavailableError(f"{len(registry.creating)} indexes are being created in this process (at most "
                               f"{MAX_CONCURRENT_CREATIONS} at once); retry", retry_after_s=1)
    registry.creating.add(name)
    started = time.perf_counter()
    try:
        files = await _model_files(registry, model, spec)
        path = await asyncio.to_thread(create_empty, root / name, files)
    except IndexExistsError as exc:  # created by another process meanwhile
        raise ConflictError(f"an index named {name!r} exists: {exc}", code="index_exists") from exc
    except (EspnError, OSError) as exc:
        logger.error("creating index %s failed: %s", name, exc)
        raise UnavailableError(f"creating index {name!r} with model {model!r} failed: {exc}",
                               code="create_failed") from exc
    finally:
        registry.creating.discard(name)
    served = registry.hold(name, path)
    logger.info("index created", extra={"index": name, "model": model,
                                        "seconds": round(time.perf_counter() - started, 1)})
    return served


async def _model_files(registry: "Registry", model: str, spec: str) -> EncoderFiles:
    """The saved files of a configured model in the root (loaded and saved at its first use, one
    load at a time per model, then kept by the registry)."""
    async with registry.model_lock(model):
        files = registry.templates.get(model)
        if files is None:
            config = registry.config.index
            # bow_dim None: saved without a projection; each index created with it fits its own on
            # its own token vectors (espn.live.create).
            encoder = await asyncio.to_thread(encoder_from_spec, spec, None, config.device,
                                              trust_remote_code=config.trust_remote_code)
            assert registry.root is not None  # checked by the caller
            files = registry.templates[model] = await asyncio.to_thread(encoder_template, registry.root, encoder)
            del encoder  # its files are saved: a created index's searches load their own
        return files


async def delete_index(registry: "Registry", name: str) -> None:
    """Refuse new requests to `name`, let those inside finish (up to the graceful time), close it,
    remove its directory."""
    root = _root(registry, "deletes")
    served = registry.held.get(name)
    if served is None or served.life.state in (Lifecycle.DELETING, Lifecycle.GONE):
        raise IndexNotFoundError(f"no index named {name!r} on this server; GET /v1/indexes lists them")
    if served.default:
        raise ConflictError(f"index {name!r} is this server's default index (served by /v1/search, ...); it cannot "
                            "be deleted over HTTP", code="index_protected")
    if served.path.parent != root or (root / name).is_symlink():
        raise ConflictError(f"index {name!r} is served from {served.path}, outside the index root {root}; only "
                            "indexes in the root can be deleted over HTTP", code="index_protected")
    life = served.life
    await life.wait_until(lambda l: l.state in (Lifecycle.CLOSED, Lifecycle.READY))  # not mid-open or mid-close
    before = life.state
    life.move(Lifecycle.DELETING)  # from now on its requests get 404
    if not await life.wait_until(lambda l: l.inside == 0, registry.config.graceful_s):
        life.move(before)
        raise UnavailableError(f"index {name!r} still has {life.inside} request(s) inside after "
                               f"{registry.config.graceful_s:g} s; nothing was deleted", retry_after_s=5)
    try:
        async with served.lock:
            if served.live is not None:
                await served.close(registry.encoders)
            await asyncio.to_thread(remove_index, root, name)
    except (EspnError, OSError) as exc:
        if not (root / name).exists():  # another process deleted it meanwhile
            life.move(Lifecycle.GONE)
            registry.forget(name)
            raise IndexNotFoundError(f"no index named {name!r} on this server (deleted)") from exc
        life.move(Lifecycle.CLOSED if served.live is None else Lifecycle.READY)
        raise UnavailableError(f"deleting index {name!r} failed: {exc}", code="delete_failed") from exc
    life.move(Lifecycle.GONE)
    registry.forget(name)
    logger.info("index deleted", extra={"index": name})
