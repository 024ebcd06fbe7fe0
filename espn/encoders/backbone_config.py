"""Backbone `config.json` files written by other transformers releases, read by the one espn installs.

transformers 5.x made its model configs strict dataclasses: a value of the wrong type is
refused with `StrictDataclassFieldValidationError` before a model is built. Configs written
by other releases (PyLate 1.6 pins transformers 5.3) can hold what that release accepted and
this one refuses:

- ModernBERT's `rope_parameters` as one flat dict (`{"rope_theta": ..., "rope_type": ...}`)
  where this release wants one per attention type (`full_attention`, `sliding_attention`);
- both at once, as PyLate 1.6.0 (transformers 5.3.0) writes a ModernBERT: one dict per attention
  type and, beside them, flat keys (`"rope_theta": null`, `"rope_type": "default"`); the
  per-type dicts are what that release ran, a non-null flat key fills what a type's dict lacks;
- top-level keys set to null that the config class types as non-null (`local_attention`,
  ...), and the null legacy RoPE keys (`global_rope_theta`, `local_rope_theta`, `rope_theta`,
  `rope_scaling`) a release writes beside `rope_parameters`.

`normalised_config_dict` rewrites such a dict to what the release that wrote it meant (a null
key falls back to the class default, which is what the writing release did with it). It runs
in memory only: `normalised_configs()` makes transformers (and Sentence Transformers, which
loads configs through it) read every config.json through it while a model loads; the user's
files are never changed. A config this release accepts is returned unchanged.

A config that is still refused after that is a one-line `RefusedInputError` naming the field and
the release that wrote it (`refused_config`), never transformers' multi-line validation error.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import threading
import types
import typing
from typing import Any, Iterator, Mapping

__all__ = ["normalised_config_dict", "normalised_configs", "refused_config", "LEGACY_ROPE_KEYS"]

log = logging.getLogger(__name__)

#: RoPE keys of earlier releases that a 5.x config carries beside `rope_parameters`, often null.
LEGACY_ROPE_KEYS = ("global_rope_theta", "local_rope_theta", "rope_theta", "rope_scaling")
#: Attention types of configs whose `rope_parameters` holds one dict per type, and the legacy
#: key that gave each type's theta.
_LAYER_ROPE_KEYS = {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"}

_lock = threading.RLock()


def _config_class(model_type: Any) -> type | None:
    if not isinstance(model_type, str):
        return None
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except KeyError:
        return None


def _accepts_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return any(_accepts_none(arg) for arg in typing.get_args(annotation))
    return False


def _non_null_fields(cls: type) -> set[str]:
    """The dataclass fields of a config class that must not be None (empty where it is no dataclass)."""
    if not dataclasses.is_dataclass(cls):
        return set()
    out = set()
    for field in dataclasses.fields(cls):
        # Field types are types, or strings where a module postpones annotations (and
        # typing.get_type_hints cannot resolve the base class's): read those by their spelling.
        kind = field.type
        nullable = (any(word in kind for word in ("None", "Optional", "Any")) if isinstance(kind, str)
                    else _accepts_none(kind))
        if not nullable:
            out.add(field.name)
    return out


def _layered_rope(cls: type) -> bool:
    """Whether `cls.rope_parameters` is one dict per attention type (ModernBERT and its kin)."""
    hints = getattr(cls, "__annotations__", {})
    return "rope_parameters" in hints and all(name in str(hints["rope_parameters"]) for name in _LAYER_ROPE_KEYS)


def _layered_rope_parameters(rope: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
    """One dict per attention type from what a release wrote: all flat (the same RoPE for every
    type, each with its own theta where the legacy keys give one), all per type, or both (the
    per-type dicts as written, a non-null flat key filling what a type's dict lacks)."""
    flat = {key: value for key, value in rope.items() if key not in _LAYER_ROPE_KEYS and value is not None}
    out: dict[str, Any] = {}
    for layer, legacy in _LAYER_ROPE_KEYS.items():
        given = rope.get(layer)
        if isinstance(given, dict):
            out[layer] = {**flat, **given}
        elif layer not in rope:
            params = dict(flat)
            if config.get(legacy) is not None:
                params["rope_theta"] = config[legacy]
            if params or not any(isinstance(rope.get(name), dict) for name in _LAYER_ROPE_KEYS):
                out[layer] = params
        else:
            out[layer] = given  # not a dict: left for the config class to refuse, naming the field
    return out


def normalised_config_dict(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` (a config.json as a dict) as this transformers release accepts it; a copy, the
    input unchanged. Only a known model_type is touched."""
    out = copy.deepcopy(dict(config))
    cls = _config_class(out.get("model_type"))
    if cls is None:
        return out
    changed: list[str] = []
    rope = out.get("rope_parameters")
    if _layered_rope(cls) and isinstance(rope, dict) and rope and set(rope) != {
            name for name in _LAYER_ROPE_KEYS if isinstance(rope.get(name), dict)}:
        out["rope_parameters"] = _layered_rope_parameters(rope, out)
        changed.append("rope_parameters")
    for key in LEGACY_ROPE_KEYS:
        if key in out and out[key] is None:
            del out[key]
            changed.append(key)
    for key in sorted(_non_null_fields(cls)):
        if key in out and out[key] is None:
            del out[key]
            changed.append(key)
    if changed:
        log.info("config.json (%s, written by transformers %s) read as this release accepts it: %s",
                 out.get("model_type"), out.get("transformers_version", "?"), ", ".join(changed))
    return out


def refused_config(exc: BaseException, config: Mapping[str, Any] | None, where: str) -> str | None:
    """One line for a config this transformers release refuses (a strict dataclass's validation
    error, after `normalised_config_dict`), naming the field and the release that wrote the
    config; None for any other exception."""
    # Here, not at the top: transformers takes seconds to import (as in _config_class).
    from huggingface_hub.errors import StrictDataclassError
    from transformers import __version__ as installed

    if not isinstance(exc, StrictDataclassError):
        return None
    text = str(exc)
    field = text.split("'")[1] if text.count("'") >= 2 else "?"
    written = (config or {}).get("transformers_version", "an unknown release") if isinstance(config, Mapping) else "?"
    value = (config or {}).get(field) if isinstance(config, Mapping) else None
    shown = json_preview(value)
    return (f"{where}: config.json field {field!r} ({shown}), written by transformers {written}, is not what "
            f"transformers {installed} reads; espn cannot load this checkpoint's configuration")


def json_preview(value: Any, limit: int = 120) -> str:
    """`value` as short JSON for an error line."""
    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@contextlib.contextmanager
def normalised_configs() -> Iterator[None]:
    """While inside, transformers reads every config.json through `normalised_config_dict`.

    The hook is transformers' public reader of configs, `PreTrainedConfig.get_config_dict` (what
    `AutoConfig`, `AutoModel` and `AutoTokenizer` call), wrapped for the duration of a load and
    restored after it; loads are serialised by a lock so that two threads never stack the hook."""
    from transformers import PretrainedConfig

    with _lock:
        original = PretrainedConfig.__dict__.get("get_config_dict")
        if not isinstance(original, classmethod):  # another transformers layout: load as it is
            yield
            return
        read = original.__func__

        def get_config_dict(cls: type, *args: Any, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
            config, unused = read(cls, *args, **kwargs)
            return normalised_config_dict(config), unused

        PretrainedConfig.get_config_dict = classmethod(get_config_dict)  # type: ignore[assignment,method-assign]
        try:
            yield
        finally:
            PretrainedConfig.get_config_dict = original  # type: ignore[assignment,method-assign]
