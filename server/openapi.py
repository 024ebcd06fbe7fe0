"""The OpenAPI document as this server's contract: the routes' schema plus what only the running server knows.

FastAPI builds the document from the routes and the request models (server/schemas.py).
Some limits depend on the settings and on the index being served, and a document without
them would admit requests the server refuses; this adds them:

- `/v1/search/batch`: `queries` holds at most ESPN_MAX_BATCH_QUERIES;
- `/v1/documents/batch`: `upsert` and `delete` hold at most ESPN_MAX_BATCH_WRITES each;
- `nprobe` is at most the index's nlist;
- `first_stage` names only the candidate generators the index holds (centroids and union need
  its token-centroid index);
- `filter` names only the index's metadata fields, each with the operators and values its
  type takes (espn.filters), so an unknown field or a wrong type is outside the schema.

Every operation also declares what the server's middleware and handlers send on any route, in
the shape they send it (`ErrorResponse`): 408 when a request body does not arrive within
ESPN_BODY_TIMEOUT_S (server.middleware.BodyLimitMiddleware), and its 422 is the handler's
`ErrorResponse`, never FastAPI's `HTTPValidationError` (server.errors). The bearer scheme and
its 401 appear only when ESPN_API_KEY is set (build_app adds them to the /v1 routers). The
document is rebuilt when the served generation changes, since a write may add metadata fields.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from espn.engine import RULES, IndexLimits

from .deps import INDEX_PARAMETER, AppState

__all__ = ["add_contract", "filter_schema"]

_FILTER_REF = {"$ref": "#/components/schemas/Filter"}
_VALUE = {"keyword": {"type": "string"}, "keywords": {"type": "string"}, "boolean": {"type": "boolean"},
          "integer": {"type": "number"}, "float": {"type": "number"}}


def _condition(kind: str) -> dict[str, Any]:
    """What one field of type `kind` takes: a value (equality), or an object of operators."""
    value = _VALUE[kind]
    values = {"type": "array", "minItems": 1, "maxItems": RULES.max_filter_values, "items": value}
    operators: dict[str, Any] = {"eq": value, "in": values, "not_in": values, "exists": {"type": "boolean"}}
    if kind in ("integer", "float"):
        operators.update({op: value for op in ("gt", "gte", "lt", "lte")})
    return {"anyOf": [value, {"type": "object", "properties": operators, "additionalProperties": False,
                              "minProperties": 1}]}


def filter_schema(fields: Mapping[str, str]) -> dict[str, Any]:
    """JSON Schema of a filter over an index whose metadata fields are `fields` (name -> type)."""
    # A filter has at most MAX_FILTER_NODES objects in all (a 422 past that); JSON Schema can bound
    # each list, not the sum.
    members: dict[str, Any] = {
        "and": {"type": "array", "minItems": 1, "maxItems": RULES.max_filter_branches, "items": _FILTER_REF},
        "or": {"type": "array", "minItems": 1, "maxItems": RULES.max_filter_branches, "items": _FILTER_REF},
        "not": _FILTER_REF,
    }
    members.update({name: _condition(kind) for name, kind in sorted(fields.items())})
    return {
        "type": "object", "properties": members, "additionalProperties": False,
        "description": f"members are anded; {{}} matches every document; at most {RULES.max_filter_nodes} objects in "
                       "all. Fields of this index: "
                       + (", ".join(f"{name} ({kind})" for name, kind in sorted(fields.items())) or "none"),
    }


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """The non-null branch of an Optional field's anyOf."""
    return next(branch for branch in schema["anyOf"] if branch.get("type") != "null")


def _add_limits(document: dict[str, Any], state: AppState, limits: Optional[IndexLimits]) -> None:
    schemas = document["components"]["schemas"]
    schemas["BatchSearchRequest"]["properties"]["queries"]["maxItems"] = state.settings.max_batch_queries
    for name in ("upsert", "delete"):
        schemas["BatchWriteRequest"]["properties"][name]["maxItems"] = state.settings.max_batch_writes
    if limits is None:  # still starting, or no default index: the limits of the index are not known
        return
    schemas["Filter"] = filter_schema(limits.filter_fields)
    for name in ("SearchRequest", "BatchSearchRequest"):
        properties = schemas[name]["properties"]
        _nullable(properties["nprobe"])["maximum"] = limits.nlist
        _nullable(properties["first_stage"])["enum"] = list(limits.first_stages)
        properties["filter"]["anyOf"] = [_FILTER_REF, {"type": "null"}]


_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
#: What the middleware sends on any route, whatever the route declares.
_EVERY_ROUTE = {"408": "the request body did not arrive whole within ESPN_BODY_TIMEOUT_S (the connection is closed)"}
_VALIDATION = "the request does not meet the schema (code `invalid_request`): the message names the field"


def _declare_sent_errors(document: dict[str, Any]) -> None:
    """Each operation's errors as the server sends them (see the module doc)."""
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            for status, description in _EVERY_ROUTE.items():
                responses.setdefault(status, {"description": description})
                responses[status]["content"] = {"application/json": {"schema": _ERROR_REF}}
            invalid = responses.get("422")
            if invalid is not None and "HTTPValidationError" in str(invalid):
                responses["422"] = {"description": _VALIDATION, "content": {"application/json": {"schema": _ERROR_REF}}}
    schemas = document.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's, now referred to by nothing
        schemas.pop(name, None)


_PER_INDEX_NOTE = ("The operation on the index `index` (an unknown name is a 404 `not_found`). The limits that "
                   "depend on the index (nprobe's maximum, first_stage, the filter's fields) are stated in this "
                   "document for the default index.")


def _name_indexes(document: dict[str, Any], names: list[str]) -> None:
    """The index names this server holds as the enum of every path parameter that names an index."""
    for path, operations in document.get("paths", {}).items():
        if not path.startswith("/v1/indexes/{"):
            continue
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                if parameter.get("in") == "path" and parameter.get("name") in (INDEX_PARAMETER, "name"):
                    parameter["schema"] = {**parameter.get("schema", {}), "enum": names}
            if path.startswith(f"/v1/indexes/{{{INDEX_PARAMETER}}}/"):
                operation["description"] = _PER_INDEX_NOTE


def add_contract(app: FastAPI) -> None:
    """Serve the document with the limits above as /openapi.json (and to /docs)."""
    cache: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        state: AppState = app.state.espn
        limits = state.engines.limits()
        names = [info.name for info in state.engines.describe()]
        key = None if limits is None else (limits.generation, tuple(names))
        if key is not None and cache.get("key") == key:
            return cache["document"]
        document = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        _add_limits(document, state, limits)
        _name_indexes(document, names)
        _declare_sent_errors(document)
        cache.update(key=key, document=document)
        return document

    app.openapi = openapi  # type: ignore[method-assign]
