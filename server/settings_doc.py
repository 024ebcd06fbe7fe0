"""Settings as a user meets them: flags, `--help` text and the docs' tables, all from the models.

Each field of `ServerSettings` and `RouterSettings` (server/settings.py) is one setting: its
environment variable is the model's prefix + the field name in capitals, its flag is
`--field-name` (the few exceptions are in `FLAG_NAMES`), its help text is the field's
description followed by `(<variable>, default <value>)`. Nothing here is written by hand per setting,
so a new field shows up in `espn serve --help` and in the docs' table as soon as it has a
description. Regenerate the tables of docs/reference/settings.md after adding or changing a field:

    python -m espn_server.settings_doc --write docs/reference/settings.md      (or: make settings-table)

tests/test_settings_doc.py fails when the page's tables differ from what this prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence

from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from .router_settings import RouterSettings
from .settings import ServerSettings

__all__ = ["Setting", "settings_of", "markdown_table", "replace_blocks", "write_readme", "FLAG_NAMES", "ENV_ONLY", "POSITIONAL"]

#: Flags whose spelling is not `--field-name` (a true-by-default switch is turned off with --no-...).
FLAG_NAMES = {
    "graceful_timeout_s": "--graceful-timeout",
    "cors_origins": "--cors-origin",
    "read_only": "--read-only",  # unset means "detect"; the flag forces read-only
    "indexes": "--index",  # repeatable: NAME=PATH
    "index_idle_close_s": "--index-idle-close",
    "models": "--model",  # repeatable: NAME=SPEC
    "index_memory_budget_mib": "--index-memory-budget",
    "index_ram_mib": "--index-ram",  # repeatable: NAME=MIB
}
#: Metavars that the field's name does not give.
METAVARS = {"indexes": "[NAME=]PATH", "models": "NAME=SPEC", "index_ram_mib": "NAME=MIB"}
#: Read from the environment only: a flag would show the secret in `ps`.
ENV_ONLY = frozenset({"api_key"})
#: Given as the command's positional argument (INDEX), not as a flag.
POSITIONAL = frozenset({"index"})



@dataclasses.dataclass(frozen=True)
class Setting:
    """One field of a settings model, as the command line and the docs present it."""

    name: str
    env: str
    flag: Optional[str]  # None: environment only, or the positional argument
    kind: str  # "bool", "list", "choice", "int", "float", "str"
    choices: tuple[str, ...]
    default: str  # as shown: "8000", "1048576 (1 MiB)", "unset", "required", "true"
    description: str

    @property
    def help(self) -> str:
        """The field's description and where it comes from, for `--help`."""
        default = "required" if self.default == "required" else f"default {self.default}"
        negated = "; this flag sets false" if self.flag is not None and self.flag.startswith("--no-") else ""
        return f"{self.description} ({self.env}, {default}{negated})"


def _base_type(annotation: Any) -> Any:
    """int for Optional[int], list for list[str], the Literal itself for a Literal."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return _base_type(args[0]) if len(args) == 1 else str
    if origin is typing.Annotated:
        return _base_type(typing.get_args(annotation)[0])
    if origin is Literal:
        return annotation
    return origin or annotation


def _kind(annotation: Any) -> tuple[str, tuple[str, ...]]:
    base = _base_type(annotation)
    if typing.get_origin(base) is Literal:
        return "choice", tuple(str(arg) for arg in typing.get_args(base))
    if base is bool:
        return "bool", ()
    if base in (list, tuple, set):
        return "list", ()
    if base is int:
        return "int", ()
    if base is float:
        return "float", ()
    return "str", ()


def _default_text(name: str, info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) if value else "empty"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and name.endswith("_bytes") and value >= 1024:
        for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if value % (1 << shift) == 0:
                return f"{value} ({value >> shift} {unit})"
    if isinstance(value, SecretStr):
        return "unset"
    return str(value)


def _flag(name: str, kind: str, default: str) -> Optional[str]:
    if name in ENV_ONLY or name in POSITIONAL:
        return None
    if name in FLAG_NAMES:
        return FLAG_NAMES[name]
    dashed = name.replace("_", "-")
    if kind == "bool" and default == "true":
        return f"--no-{dashed}"
    if kind == "bool" and default == "unset":  # Optional[bool]: the flag states the non-default choice
        return f"--no-{dashed}"
    return f"--{dashed}"


def settings_of(model: type[BaseSettings]) -> list[Setting]:
    """Every field of `model`, in declaration order. A field without a description is an error."""
    prefix = str(model.model_config.get("env_prefix", ""))
    out = []
    for name, info in model.model_fields.items():
        if not info.description:
            raise ValueError(f"{model.__name__}.{name} has no description: give it Field(..., description=...), "
                             "which --help and the docs' settings table show")
        kind, choices = _kind(info.annotation)
        default = _default_text(name, info)
        out.append(Setting(name=name, env=prefix + name.upper(), flag=_flag(name, kind, default), kind=kind,
                           choices=choices, default=default, description=info.description))
    return out


def add_flags(parser: argparse.ArgumentParser, model: type[BaseSettings], groups: Sequence[tuple[str, Sequence[str]]],
              other: str = "other settings") -> None:
    """One flag per field of `model` (dest = the field name), grouped as `groups` lists them.

    Fields no group names land in `other`, so a new field is never missing from --help.
    Values stay strings: the flags become environment variables and the model parses them.
    """
    settings = {s.name: s for s in settings_of(model)}
    placed = [name for _, names in groups for name in names]
    unknown = sorted(set(placed) - set(settings))
    if unknown:
        raise ValueError(f"groups name fields that {model.__name__} does not have: {', '.join(unknown)}")
    rest = [name for name in settings if name not in placed]
    for title, names in [*groups, (other, rest)]:
        if not any(settings[name].flag for name in names):
            continue
        group = parser.add_argument_group(title)
        for name in names:
            setting = settings[name]
            if setting.flag is None:
                continue
            help_text = setting.help.replace("%", "%%")
            if setting.kind == "bool":
                value = "false" if setting.flag.startswith("--no-") else "true"
                group.add_argument(setting.flag, dest=name, action="store_const", const=value, help=help_text)
            elif setting.kind == "list":
                group.add_argument(setting.flag, dest=name, action="append",
                                   metavar=METAVARS.get(name, name.split("_")[-1].upper().rstrip("S")),
                                   help=help_text + "; repeatable")
            elif setting.kind == "choice":
                group.add_argument(setting.flag, dest=name, choices=setting.choices, help=help_text)
            else:
                metavar = {"int": "N", "float": "X"}.get(setting.kind, name.split("_")[-1].upper())
                group.add_argument(setting.flag, dest=name, metavar=metavar, help=help_text)


def environment_help(model: type[BaseSettings]) -> str:
    """The --help epilog: settings that have no flag (environment only)."""
    lines = [f"Environment only, {s.env}: {s.help}." for s in settings_of(model) if s.name in ENV_ONLY]
    lines.append("Every flag can also be given as its environment variable; a flag wins over the variable.")
    return " ".join(lines).replace("%", "%%")


def markdown_table(model: type[BaseSettings]) -> str:
    """The Markdown table of `model`'s settings (docs/reference/settings.md): variable, flag, default, meaning."""
    rows = ["| variable | flag | default | meaning |", "|---|---|---|---|"]
    for s in settings_of(model):
        flag = f"`{s.flag}`" if s.flag else ("INDEX (the argument)" if s.name in POSITIONAL else "none (environment only)")
        description = s.description.replace("|", "\\|")
        rows.append(f"| `{s.env}` | {flag} | `{s.default}` | {description} |")
    return "\n".join(rows) + "\n"


def _tables() -> dict[str, str]:
    return {"serve": markdown_table(ServerSettings), "route": markdown_table(RouterSettings)}


def replace_blocks(path: Path, blocks: Mapping[str, str], tag: str, check: bool = False) -> bool:
    """Replace each `<!-- TAG:NAME -->` ... `<!-- /TAG -->` block of `path` with `blocks[NAME]`
    (every NAME must have its block); rewrite the file unless `check`. True if it changed."""
    text = path.read_text(encoding="utf-8")
    marker = re.compile(rf"<!-- {tag}:(\w+) -->\n.*?<!-- /{tag} -->", re.S)
    missing = sorted(set(blocks) - {match.group(1) for match in marker.finditer(text)})
    if missing:
        raise ValueError(f"{path}: no <!-- {tag}:{missing[0]} --> ... <!-- /{tag} --> block")
    updated = marker.sub(lambda m: f"<!-- {tag}:{m.group(1)} -->\n{blocks[m.group(1)].rstrip()}\n<!-- /{tag} -->", text)
    if updated != text and not check:
        path.write_text(updated, encoding="utf-8")
    return updated != text


def write_readme(path: Path, check: bool = False) -> bool:
    """Replace each `<!-- settings-table:NAME -->` ... `<!-- /settings-table -->` block; True if it changed."""
    return replace_blocks(path, _tables(), "settings-table", check)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m espn_server.settings_doc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, metavar="PAGE", help="rewrite the settings tables in this file (docs/reference/settings.md)")
    parser.add_argument("--check", type=Path, metavar="PAGE", help="exit 1 if this file's tables are out of date")
    args = parser.parse_args(argv)
    if args.write:
        changed = write_readme(args.write)
        print(f"{args.write}: settings tables {'updated' if changed else 'already up to date'}")
        return 0
    if args.check:
        if write_readme(args.check, check=True):
            print(f"{args.check}: settings tables are out of date; run `make settings-table`", file=sys.stderr)
            return 1
        return 0
    for name, table in _tables().items():
        print(f"espn {name}:\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
