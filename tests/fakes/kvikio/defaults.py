"""kvikio.defaults of 26.10: `set(*config)`, `get(config_name)`, `is_compat_mode_preferred()`."""

from __future__ import annotations

from typing import Any

from ._system import CompatMode, _fake

__all__ = ["CompatMode", "set", "get", "is_compat_mode_preferred"]

_NAMES = ("compat_mode", "num_threads", "task_size", "gds_threshold", "bounce_buffer_size")


class ConfigContextManager:
    """Sets on construction; resets on leaving a `with` block (as the real one)."""

    def __init__(self, config: dict[str, Any]):
        self._old = {key: get(key) for key in config}
        for key, value in config.items():
            _set_one(key, value)

    def __enter__(self) -> None:
        return None

    def __exit__(self, type_unused: Any, value: Any, traceback_unused: Any) -> None:
        for key, value in self._old.items():
            _set_one(key, value)


def _name(key: str) -> str:
    key = "num_threads" if key == "thread_pool_nthreads" else key
    if key not in _NAMES:
        raise KeyError(key)
    return key


def _set_one(key: str, value: Any) -> None:
    key = _name(key)
    if key == "compat_mode":
        value = CompatMode(value) if not isinstance(value, str) else CompatMode[value.upper()]
    elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{key} needs a non-negative integer, got {value!r}")
    if key == "num_threads":
        if value < 1:
            raise ValueError("num_threads must be positive")
        _fake.set_threads(value)
    _fake.settings[key] = value


def set(*config) -> ConfigContextManager:  # type: ignore[no-untyped-def]
    err_msg = (
        "Valid arguments are kvikio.defaults.set(config: dict) or "
        "kvikio.defaults.set(key: str, value: Any)"
    )
    if len(config) == 1:
        if not isinstance(config[0], dict):
            raise ValueError(err_msg)
        _fake.set_calls.append(dict(config[0]))
        return ConfigContextManager(config[0])
    if len(config) == 2:
        if not isinstance(config[0], str):
            raise ValueError(err_msg)
        _fake.set_calls.append({config[0]: config[1]})
        return ConfigContextManager({config[0]: config[1]})
    raise ValueError(err_msg)


def get(config_name: str) -> Any:
    return _fake.settings[_name(config_name)]


def is_compat_mode_preferred() -> bool:
    mode = _fake.settings["compat_mode"]
    return mode == CompatMode.ON or (mode == CompatMode.AUTO and _fake.gds_unavailable)
