"""The filter language: JSON -> validated tree -> a bool mask over internal doc numbers.

The same JSON is accepted by `Searcher.search(..., filter=...)`, `espn search --filter` and
the `"filter"` member of `/v1/search` and `/v1/search/batch`:

    {"source": "arxiv"}                          equality (keyword, number, boolean);
                                                 on a list of keywords: contains
    {"source": {"in": ["a", "b"]}}               one of (on a list: any of)
    {"source": {"not_in": ["a", "b"]}}           none of; documents without the field match
    {"year": {"gte": 2000, "lt": 2010}}          ranges (integer and float fields)
    {"lang": {"exists": true}}                   the field has a value
    {"and": [F, ...]}, {"or": [F, ...]}, {"not": F}
    {"source": "arxiv", "year": {"gte": 2000}}   several members of one object: and
    {}                                           every document

Everything is checked against the index's fields before any work: an unknown field, a
value of the wrong type or a malformed filter raises `FilterError` (an
`InvalidParameterError`) naming where in the filter the problem is. Compiling costs one
vectorised pass over the columns it touches; `FilterCache` keeps recent results.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from typing import Any, Callable, Generic, Mapping, TypeVar, Union

import numpy as np

from .errors import InvalidParameterError
from .metadata import BooleanColumn, KeywordColumn, MetadataColumns, NumberColumn, SegmentedColumns

__all__ = ["FilterError", "Condition", "And", "Or", "Not", "parse_filter", "compile_filter", "canonical_filter",
           "FilterCache", "MAX_FILTER_NODES", "MAX_FILTER_VALUES", "MAX_FILTER_BRANCHES"]

MAX_FILTER_NODES = 256
MAX_FILTER_VALUES = 10_000  # per `in` / `not_in` list
MAX_FILTER_BRANCHES = 64  # per `and` / `or` list (with MAX_FILTER_NODES, the bounds an HTTP schema can state)
OPERATORS = ("eq", "in", "not_in", "gt", "gte", "lt", "lte", "exists")
RANGES = ("gt", "gte", "lt", "lte")


class FilterError(InvalidParameterError):
    """A filter that is malformed or does not fit the index's fields; the message says where."""


@dataclasses.dataclass(frozen=True)
class Condition:
    field: str
    op: str
    value: Any


@dataclasses.dataclass(frozen=True)
class And:
    children: tuple["Node", ...]


@dataclasses.dataclass(frozen=True)
class Or:
    children: tuple["Node", ...]


@dataclasses.dataclass(frozen=True)
class Not:
    child: "Node"


Node = Union[Condition, And, Or, Not]


def canonical_filter(spec: Any) -> str:
    """One string per distinct filter (member order ignored): the cache key."""
    if isinstance(spec, str):
        spec = _loads(spec)
    try:
        return json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise FilterError(f"filter: not a JSON value ({exc})") from None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise FilterError(f"filter: not valid JSON ({exc.msg} at column {exc.colno})") from None


def parse_filter(spec: Any, schema: Mapping[str, str]) -> Node | None:
    """Validate `spec` (a JSON object, or its text) against `schema` (field -> type); None = every document."""
    if isinstance(spec, str):
        spec = _loads(spec)
    budget = [MAX_FILTER_NODES]
    node = _parse(spec, schema, "filter", budget)
    return node


def _parse(spec: Any, schema: Mapping[str, str], where: str, budget: list[int]) -> Node | None:
    if not isinstance(spec, dict):
        raise FilterError(f"{where}: expected a JSON object, got {_describe(spec)}")
    budget[0] -= 1
    if budget[0] < 0:
        raise FilterError(f"filter: more than {MAX_FILTER_NODES} conditions")
    parts: list[Node] = []
    for key, value in spec.items():
        here = f"{where}.{key}"
        if key in ("and", "or"):
            if not isinstance(value, list) or not value:
                raise FilterError(f"{here}: expected a non-empty list of filters, got {_describe(value)}")
            if len(value) > MAX_FILTER_BRANCHES:
                raise FilterError(f"{here}: more than {MAX_FILTER_BRANCHES} filters")
            children = [_parse(item, schema, f"{here}[{i}]", budget) for i, item in enumerate(value)]
            if key == "and":
                parts.append(And(tuple(_everything(c) for c in children)))
            else:
                parts.append(Or(tuple(_everything(c) for c in children)))
        elif key == "not":
            parts.append(Not(_everything(_parse(value, schema, here, budget))))
        else:
            parts += _parse_field(key, value, schema, here, budget)
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else And(tuple(parts))


def _everything(node: Node | None) -> Node:
    """`{}` inside and/or/not means every document: the negation of exists-nothing."""
    return node if node is not None else Not(Or(()))


def _parse_field(name: str, value: Any, schema: Mapping[str, str], where: str, budget: list[int]) -> list[Node]:
    kind = schema.get(name)
    if kind is None:
        known = ", ".join(sorted(schema)) or "none: the index has no metadata"
        raise FilterError(f"{where}: unknown field {name!r} (fields: {known})")
    if not isinstance(value, dict):
        if isinstance(value, list):
            raise FilterError(f"{where}: a list is not a value; use {{\"in\": [...]}}")
        return [Condition(name, "eq", _check_value(value, kind, name, where))]
    if not value:
        raise FilterError(f"{where}: empty operator object; use one of {', '.join(OPERATORS)}")
    out: list[Node] = []
    for op, operand in value.items():
        here = f"{where}.{op}"
        if op not in OPERATORS:
            raise FilterError(f"{here}: unknown operator {op!r} (one of {', '.join(OPERATORS)})")
        if op == "exists":
            if not isinstance(operand, bool):
                raise FilterError(f"{here}: expected true or false, got {_describe(operand)}")
            out.append(Condition(name, op, operand))
        elif op in ("in", "not_in"):
            if not isinstance(operand, list) or not operand:
                raise FilterError(f"{here}: expected a non-empty list, got {_describe(operand)}")
            if len(operand) > MAX_FILTER_VALUES:  # per list: a bound JSON Schema can state (maxItems)
                raise FilterError(f"{here}: more than {MAX_FILTER_VALUES} values")
            values = tuple(_check_value(v, kind, name, f"{here}[{i}]") for i, v in enumerate(operand))
            out.append(Condition(name, op, values))
        elif op in RANGES:
            if kind not in ("integer", "float"):
                raise FilterError(f"{here}: range operators apply to integer and float fields; {name!r} is {kind}")
            out.append(Condition(name, op, _check_value(operand, kind, name, here)))
        else:  # eq
            out.append(Condition(name, op, _check_value(operand, kind, name, here)))
    return out


def _check_value(value: Any, kind: str, name: str, where: str) -> Any:
    if kind in ("keyword", "keywords"):
        if not isinstance(value, str):
            raise FilterError(f"{where}: field {name!r} is {kind}; expected a string, got {_describe(value)}")
        return value
    if kind == "boolean":
        if not isinstance(value, bool):
            raise FilterError(f"{where}: field {name!r} is boolean; expected true or false, got {_describe(value)}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (
            float("inf"), float("-inf")):
        raise FilterError(f"{where}: field {name!r} is {kind}; expected a finite number, got {_describe(value)}")
    return value


def _describe(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def compile_filter(node: Node | None, columns: MetadataColumns | SegmentedColumns) -> np.ndarray:
    """[N] bool: the documents `node` admits (every document for None)."""
    if isinstance(columns, SegmentedColumns):
        return np.concatenate([compile_filter(node, part) for part in columns.parts])
    n = columns.num_documents
    if node is None:
        return np.ones(n, dtype=bool)
    if isinstance(node, And):
        mask = np.ones(n, dtype=bool)
        for child in node.children:
            mask &= compile_filter(child, columns)
        return mask
    if isinstance(node, Or):
        mask = np.zeros(n, dtype=bool)
        for child in node.children:
            mask |= compile_filter(child, columns)
        return mask
    if isinstance(node, Not):
        return ~compile_filter(node.child, columns)
    return _condition(node, columns.fields[node.field])


def _condition(cond: Condition, column: Any) -> np.ndarray:
    op, value = cond.op, cond.value
    if op == "exists":
        present = column.present()
        return present if value else ~present
    if isinstance(column, KeywordColumn):
        if op == "eq":
            return column.any_of([value])
        hit = column.any_of(list(value))
        return hit if op == "in" else ~hit
    if isinstance(column, BooleanColumn):
        values = np.asarray(column.values)
        wanted = [value] if op == "eq" else list(value)
        hit = np.isin(values, [1 if v else 0 for v in wanted])
        return hit if op != "not_in" else ~hit
    assert isinstance(column, NumberColumn)
    values, present = np.asarray(column.values), column.present()
    if op == "eq":
        return present & (values == value)
    if op in ("in", "not_in"):
        hit = present & np.isin(values, np.asarray(value))
        return hit if op == "in" else ~hit
    compare: dict[str, Callable[[np.ndarray, Any], np.ndarray]] = {
        "gt": np.greater, "gte": np.greater_equal, "lt": np.less, "lte": np.less_equal}
    return present & compare[op](values, value)


K = TypeVar("K")
V = TypeVar("V")


class FilterCache(Generic[K, V]):
    """A thread-safe LRU bounded by the bytes its values hold (`size(value)`) and by entries."""

    def __init__(self, max_bytes: int, size: Callable[[V], int], max_entries: int = 64) -> None:
        self.max_bytes, self.max_entries, self._size = max_bytes, max_entries, size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        """Keep `value` unless it alone exceeds the budget; evict the least recently used first."""
        size = self._size(value)
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = value
            self._bytes += size
            while self._bytes > self.max_bytes or len(self._items) > self.max_entries:
                _, old = self._items.popitem(last=False)
                self._bytes -= self._size(old)

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes
