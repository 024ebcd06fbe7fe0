"""The part of kvikio's Python API the reader relies on, as (name, kind, default) triples.

`signatures_from_wheel` reads them out of a kvikio wheel with `ast` (no import, so no
libkvikio or CUDA needed); `signatures_from_modules` from an importable package (the real
one or the fake). `kvikio_26.10.0_signatures.json` is the record taken from the wheel
`kvikio_cu12-26.10.0-cp311-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl`:
regenerate it with `python tests/fakes/kvikio_api.py WHEEL > NEW.json` (the
"observed_by_import" part, kvikio's enum values and start-up defaults, comes from importing
that wheel with libkvikio: `import kvikio` works without libcuda).
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

RECORD = Path(__file__).with_name("kvikio_26.10.0_signatures.json")

#: module (inside the kvikio package) -> functions and "Class.method" names
API: dict[str, list[str]] = {
    "cufile": [
        "CuFile.__init__", "CuFile.close", "CuFile.fileno", "CuFile.open_flags", "CuFile.__enter__",
        "CuFile.__exit__", "CuFile.pread", "CuFile.read", "CuFile.is_direct_io_supported",
        "IOFuture.__init__", "IOFuture.get", "IOFuture.done",
    ],
    "defaults": ["set", "get", "is_compat_mode_preferred"],
}

Param = list[str]  # [name, kind, default or "<empty>"]

_AST_KINDS = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "KEYWORD_ONLY", "VAR_KEYWORD")


def _params_from_ast(fn: ast.FunctionDef) -> list[Param]:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out: list[Param] = []
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append([arg.arg, kind, "<empty>" if default is None else ast.unparse(default)])
    if a.vararg:
        out.append([a.vararg.arg, "VAR_POSITIONAL", "<empty>"])
    for arg, kw_default in zip(a.kwonlyargs, a.kw_defaults):
        out.append([arg.arg, "KEYWORD_ONLY", "<empty>" if kw_default is None else ast.unparse(kw_default)])
    if a.kwarg:
        out.append([a.kwarg.arg, "VAR_KEYWORD", "<empty>"])
    return out


def _is_overload(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "overload" for d in fn.decorator_list)


def signatures_from_source(module: str, source: str) -> dict[str, list[Param]]:
    tree = ast.parse(source)
    found: dict[str, list[Param]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not _is_overload(node):
            found[node.name] = _params_from_ast(node)  # the last definition wins, as at run time
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    found[f"{node.name}.{item.name}"] = _params_from_ast(item)
    return {f"{module}.{name}": found[name] for name in API[module] if name in found}


def signatures_from_wheel(wheel: Path) -> dict[str, Any]:
    with zipfile.ZipFile(wheel) as zf:
        version = zf.read("kvikio/VERSION").decode().strip() if "kvikio/VERSION" in zf.namelist() else "?"
        sigs: dict[str, list[Param]] = {}
        for module in API:
            sigs.update(signatures_from_source(module, zf.read(f"kvikio/{module}.py").decode()))
    return {"package": "kvikio-cu12", "version": version, "wheel": Path(wheel).name, "signatures": sigs}


def _params_from_callable(fn: Any) -> list[Param]:
    out: list[Param] = []
    for p in inspect.signature(fn).parameters.values():
        default = "<empty>" if p.default is inspect.Parameter.empty else repr(p.default)
        out.append([p.name, p.kind.name, default])
    return out


def signatures_from_modules(modules: dict[str, ModuleType]) -> dict[str, list[Param]]:
    """modules: {"cufile": <kvikio.cufile>, "defaults": <kvikio.defaults>} (real or fake)."""
    sigs: dict[str, list[Param]] = {}
    for module, names in API.items():
        for name in names:
            obj: Any = modules[module]
            for part in name.split("."):
                obj = getattr(obj, part)
            sigs[f"{module}.{name}"] = _params_from_callable(obj)
    return sigs


def load_record() -> dict[str, Any]:
    return json.loads(RECORD.read_text())


def dump_record(record: dict[str, Any]) -> str:
    """The record as JSON, one signature per line."""
    head = {k: v for k, v in record.items() if k not in ("signatures", "observed_by_import")}
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + [' "signatures": {']
    items = list(record["signatures"].items())
    lines += [f"  {json.dumps(k)}: {json.dumps(v)}" + ("," if i < len(items) - 1 else "") for i, (k, v) in enumerate(items)]
    lines.append(" }" + ("," if "observed_by_import" in record else ""))
    if "observed_by_import" in record:
        lines.append(' "observed_by_import": ' + json.dumps(record["observed_by_import"]))
    return "\n".join(lines + ["}"]) + "\n"


if __name__ == "__main__":
    # The observed values (enum, defaults) come from importing the wheel, not from its
    # sources: carried over from the existing record; check them by hand on a new version.
    new = signatures_from_wheel(Path(sys.argv[1]))
    if RECORD.is_file():
        new["observed_by_import"] = load_record().get("observed_by_import", {})
    sys.stdout.write(dump_record(new))
