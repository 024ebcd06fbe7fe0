"""What holds the typed client to the server and to itself, read from source (no server runs).

- Its models against the server's OpenAPI document (docs/reference/openapi.json, which
  `python -m tools.docs_pages docs --check` keeps equal to what the app publishes): every
  field of every model has the schema's name, type (refs, arrays, enums and nullability
  included), required-ness and, for results, default. Requests may also take null for an
  optional field: the client sends nothing for it, and the server uses its default.
- Its sync half against its async half: client.py is what clients/python/scripts/unasync.py
  writes from async_client.py, holds no `async` or `await`, and has the same methods.
- Its reference page against its constants: the defaults it quotes are the code's.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

import espn_client
from espn_client import AsyncClient, Client, RetryPolicy, models

ROOT = Path(__file__).resolve().parents[1]
OPENAPI = ROOT / "docs" / "reference" / "openapi.json"
UNASYNC = ROOT / "clients" / "python" / "scripts" / "unasync.py"
REFERENCE = ROOT / "docs" / "reference" / "python-client.md"
#: Each client model and the server's schema it stands for (components/schemas of the document).
MODELS: dict[type[models.BaseModel], str] = {
    models.SearchRequest: "SearchRequest", models.BatchSearchRequest: "BatchSearchRequest",
    models.DocumentWrite: "DocumentWrite", models.DocumentUpsert: "DocumentUpsert",
    models.BatchWriteRequest: "BatchWriteRequest", models.SnapshotRequest: "SnapshotRequest",
    models.CreateIndexRequest: "CreateIndexRequest",
    models.PassageSpan: "PassageSpanModel", models.TokenMatch: "TokenMatchModel",
    models.Explanation: "ExplanationModel", models.LexicalMatch: "LexicalMatchModel", models.SearchHit: "SearchHit",
    models.SearchStats: "SearchStatsModel", models.SearchResponse: "SearchResponse", models.QueryError: "QueryError",
    models.BatchSearchResponse: "BatchSearchResponse", models.Document: "DocumentResponse",
    models.WriteResponse: "WriteResponse", models.Health: "HealthResponse", models.Readiness: "ReadinessResponse",
    models.SnapshotInfo: "SnapshotInfo", models.SnapshotList: "SnapshotList", models.ErrorBody: "ErrorResponse",
    models.IndexInfo: "IndexInfo", models.IndexList: "IndexListResponse",
}
#: Models of the client with no schema of their own: the parameters both search requests share,
#: and the limits read from the document's `maxItems`.
NOT_SCHEMAS = {"SearchParams", "ServerLimits"}


@pytest.fixture(scope="module")
def schemas() -> dict[str, Any]:
    return json.loads(OPENAPI.read_text(encoding="utf-8"))["components"]["schemas"]


# -- the models against the document --------------------------------------------------------------

def canonical(prop: dict[str, Any], name_of: Callable[[str], str]) -> Any:
    """A property's JSON type as a comparable value: refs by schema name (`name_of` maps the
    client's), anyOf as a set, arrays and maps by their items, enums by their values."""
    if "$ref" in prop:
        return ("ref", name_of(prop["$ref"].rsplit("/", 1)[1]))
    if "anyOf" in prop or "oneOf" in prop:
        members = frozenset(canonical(member, name_of) for member in prop.get("anyOf", prop.get("oneOf")))
        return next(iter(members)) if len(members) == 1 else ("anyOf", members)
    if "enum" in prop or "const" in prop:
        return ("enum", frozenset(prop.get("enum", [prop.get("const")])))
    kind = prop.get("type")
    if kind == "array":
        return ("array", canonical(prop.get("items", {}), name_of))
    if kind == "object":
        values = prop.get("additionalProperties", True)
        return ("object", "any" if values in (True, {}) else canonical(values, name_of))
    return kind or "any"


def mismatches(model: type[models.BaseModel], theirs: dict[str, Any]) -> list[str]:
    """How the model differs from its schema: one line per difference (none: it matches)."""
    ours = model.model_json_schema(ref_template="#/$defs/{model}")
    by_class = {cls.__name__: schema for cls, schema in MODELS.items()}
    name_of: Callable[[str], str] = lambda name: by_class.get(name, f"(client model {name} has no schema)")
    request = issubclass(model, models._Request)
    found = []
    for name in sorted(set(theirs["properties"]) ^ set(ours["properties"])):
        found.append(f"{name}: only in {'the schema' if name in theirs['properties'] else 'the client'}")
    for name in sorted(set(theirs.get("required", [])) ^ set(ours.get("required", []))):
        found.append(f"{name}: required in {'the schema' if name in theirs.get('required', []) else 'the client'} only")
    for name in sorted(set(theirs["properties"]) & set(ours["properties"])):
        their_prop, our_prop = theirs["properties"][name], ours["properties"][name]
        their_type, our_type = canonical(their_prop, str), canonical(our_prop, name_of)
        optional = name not in theirs.get("required", [])
        if our_type != their_type and not (request and optional and our_type == _or_null(their_type)):
            found.append(f"{name}: type {our_type} in the client, {their_type} in the schema")
        if not request and "default" in their_prop and our_prop.get("default", "(none)") != their_prop["default"]:
            found.append(f"{name}: default {our_prop.get('default', '(none)')!r} in the client, "
                         f"{their_prop['default']!r} in the schema")
    return found


def _or_null(kind: Any) -> Any:
    members = set(kind[1]) if isinstance(kind, tuple) and kind[0] == "anyOf" else {kind}
    return ("anyOf", frozenset(members | {"null"}))


@pytest.mark.parametrize("client_model", list(MODELS), ids=lambda m: m.__name__)
def test_every_field_of_every_model_matches_the_openapi_document(client_model, schemas) -> None:
    assert mismatches(client_model, schemas[MODELS[client_model]]) == []


def test_every_model_of_the_client_has_its_schema() -> None:
    named = {name for name in models.__all__ if isinstance(getattr(models, name), type)}
    assert named - NOT_SCHEMAS == {cls.__name__ for cls in MODELS}


@pytest.mark.parametrize("drift, expected", [
    (lambda s: s["properties"].pop("bow_score"), "bow_score: only in the client"),
    (lambda s: s["properties"].update(rank={"type": "integer"}), "rank: only in the schema"),
    (lambda s: s["required"].remove("cls_score"), "cls_score: required in the client only"),
    (lambda s: s["required"].append("title"), "title: required in the schema only"),
    (lambda s: s["properties"]["score"].update(type="string"), "score: type number in the client, string"),
    (lambda s: s["properties"]["text"]["anyOf"].pop(), "text: type ('anyOf'"),
    (lambda s: s["properties"]["explanation"]["anyOf"][0].update({"$ref": "#/components/schemas/QueryError"}),
     "explanation: type"),
    (lambda s: s["properties"]["lexical_matches"]["anyOf"][0]["items"].update(
        {"$ref": "#/components/schemas/PassageSpanModel"}), "lexical_matches: type"),
    (lambda s: s["properties"]["title"].update(default="untitled"), "title: default None in the client, 'untitled'"),
])
def test_a_drift_of_the_document_is_found(schemas, drift: Callable[[dict[str, Any]], Any], expected: str) -> None:
    """Each kind of difference, made in a copy of SearchHit's schema, is reported."""
    drifted = json.loads(json.dumps(schemas["SearchHit"]))
    drift(drifted)
    assert any(line.startswith(expected) for line in mismatches(models.SearchHit, drifted)), (
        expected, mismatches(models.SearchHit, drifted))


def test_a_request_field_the_server_defaults_may_be_left_out_but_not_retyped(schemas) -> None:
    drifted = json.loads(json.dumps(schemas["SearchRequest"]))
    assert mismatches(models.SearchRequest, drifted) == []  # k: integer there, integer or null (unsent) here
    drifted["properties"]["k"]["type"] = "string"
    (line,) = mismatches(models.SearchRequest, drifted)
    assert line.startswith("k: type ('anyOf'") and line.endswith("in the client, string in the schema")


# -- the sync client against the async one -------------------------------------------------------

def _unasync_module() -> Any:
    spec = importlib.util.spec_from_file_location("unasync", UNASYNC)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sync_client_is_what_the_script_writes_from_the_async_one() -> None:
    done = subprocess.run([sys.executable, str(UNASYNC), "--check"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    unasync = _unasync_module()
    source = unasync.SOURCE.read_text(encoding="utf-8")
    assert unasync.unasync(source) == unasync.TARGET.read_text(encoding="utf-8")
    assert unasync.unasync(source + "\n\nasync def extra() -> None:\n    await sleep(1)\n").endswith(
        "\n\ndef extra() -> None:\n    sleep(1)\n")
    with pytest.raises(SystemExit, match="no longer holds the sentence"):  # a sync sentence left stale
        unasync.unasync(source.replace("It belongs to one event loop.", "It belongs to its event loop."))


def test_the_sync_client_holds_no_async_code() -> None:
    tree = ast.parse((ROOT / "clients" / "python" / "espn_client" / "client.py").read_text(encoding="utf-8"))
    asynchronous = [f"line {node.lineno}: {type(node).__name__}" for node in ast.walk(tree)
                    if isinstance(node, (ast.AsyncFunctionDef, ast.Await, ast.AsyncFor, ast.AsyncWith))]
    assert asynchronous == []


def _public(cls: type) -> dict[str, Optional[inspect.Signature]]:
    return {name: inspect.signature(member) if callable(member) else None
            for name, member in vars(cls).items() if not name.startswith("_") or name == "__init__"}


def test_both_clients_have_the_same_methods_and_parameters() -> None:
    sync, asynchronous = _public(Client), _public(AsyncClient)
    assert sync.keys() == asynchronous.keys()
    for name, signature in sync.items():
        other = asynchronous[name]
        assert (signature is None) == (other is None), name
        if signature is not None and other is not None:
            assert [(p.name, p.kind, p.default) for p in signature.parameters.values()] == [
                (p.name, p.kind, p.default) for p in other.parameters.values()], name
            assert inspect.iscoroutinefunction(getattr(AsyncClient, name)) != (name in ("__init__", "__repr__")), name


# -- the reference page against the constants ------------------------------------------------------

def test_the_reference_page_quotes_the_clients_defaults() -> None:
    page = REFERENCE.read_text(encoding="utf-8")
    parameters = inspect.signature(Client).parameters.values()
    shown = ", ".join(f"{p.name}=RetryPolicy()" if p.default == RetryPolicy() else f"{p.name}={p.default!r}"
                      for p in parameters if p.default is not inspect.Parameter.empty)
    assert f"`Client(base_url, *, {shown})`" in page
    for name in ("DEFAULT_TIMEOUT_S", "DEFAULT_DEADLINE_S", "DEFAULT_MAX_ANSWER_BYTES", "MAX_ERROR_BODY_BYTES"):
        assert f"| `{name}` | {getattr(espn_client, name)!r}" in page, name
    for error in ("DeadlineExceededError", "ResponseTooLargeError", "MalformedResponseError", "ResponseError"):
        assert f"| `{error}` |" in page, error
