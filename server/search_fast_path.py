"""POST /v1/search answered without FastAPI's request machinery, for the requests it can take.

A single search is the one request whose HTTP layer is a visible share of its answer: the
search itself takes a few milliseconds, and on the 2-vCPU VM FastAPI's routing, dependency
solving, body parsing and exception layers took about 0.8 ms of it before the route ran
(issue 34). This layer sits inside the project's own middlewares (the access log, the API
key, the body limit and the shutdown guard still see every request) and in front of FastAPI.
It takes a request whose body is a valid `SearchRequest` in JSON and runs the route's own
code (`routes.search.search_one`); anything else, a body FastAPI would refuse included, goes
on to FastAPI with the body replayed, so every error is FastAPI's own answer, byte for byte.
An error of the search itself goes through the app's exception handlers, as in the route.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping

from pydantic import ValidationError
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from .deps import AppState, state_of
from .middleware import read_body, replay_body
from .routes.search import search_one
from .schemas import SearchRequest

__all__ = ["SearchFastPath"]

PATH = "/v1/search"


def _is_json(scope: Scope) -> bool:
    for key, value in scope.get("headers", ()):
        if key == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


class SearchFastPath:
    """`POST /v1/search` with a valid JSON body, straight to the route's code (see the module doc)."""

    def __init__(self, app: ASGIApp, state: AppState, handlers: Mapping[Any, Callable[..., Any]]) -> None:
        self.app = app
        self.state = state
        self.handlers = handlers  # the app's exception handlers (the same dict FastAPI consults)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "POST" or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)  # already buffered by the body limit: one message
        if body is None:
            return  # the client left before its body arrived: nobody to answer
        try:
            # json.loads, then the model from Python objects: what FastAPI does with a JSON body.
            options = SearchRequest.model_validate(json.loads(body))
        except (ValueError, ValidationError):  # not JSON, not UTF-8, or not a valid request
            await self.app(scope, replay_body(body, receive), send)
            return
        request = Request(scope, receive)
        try:
            response = await search_one(state_of(self.state, scope).require_search(), request, options)
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:
                raise  # a bug stays a bug: uvicorn answers 500 without a traceback and logs it
            response = await handler(request, exc)
        await response(scope, receive, send)

    def _handler(self, exc: Exception) -> Callable[..., Any] | None:
        """The closest registered handler of `exc`'s class, as Starlette chooses it."""
        for cls in type(exc).__mro__:
            if cls in self.handlers:
                return self.handlers[cls]
        return None

