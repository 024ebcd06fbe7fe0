"""POST /v1/search (and /v1/indexes/{index}/search) answered without FastAPI's request
machinery, for the requests it can take.

A single search is the one request whose HTTP layer is a visible share of its answer: the
search itself takes a few milliseconds, and on the 2-vCPU VM FastAPI's routing, dependency
solving, body parsing and exception layers took about 0.8 ms of it before the route ran.
This layer sits inside the project's own middlewares (the access log, the API key, the body
limit and the shutdown guard still see every request) and in front of FastAPI. It takes a
request whose body is a valid `SearchRequest` in JSON and runs the route's own code
(`routes.search.search_one`) on the index the path names; anything else, a body FastAPI
would refuse included, goes on to FastAPI with the body replayed, so every error is
FastAPI's own answer, byte for byte. An error of the search itself is answered as the
app's exception handler answers it (`errors.library_error_response`).
"""

from __future__ import annotations

import json
import re

from pydantic import ValidationError
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from espn.engine import RULES, Engines
from espn.errors import EspnError

from .errors import library_error_response
from .middleware import read_body, replay_body
from .routes.search import search_one
from .schemas import SearchRequest

__all__ = ["SearchFastPath"]

#: The default index's search, and a named index's (the name as the library's rule has it).
PATH = re.compile(rf"/v1(?:/indexes/(?P<index>{RULES.index_name_pattern}))?/search")


def _is_json(scope: Scope) -> bool:
    for key, value in scope.get("headers", ()):
        if key == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


class SearchFastPath:
    """`POST /v1/search` with a valid JSON body, straight to the route's code (see the module doc)."""

    def __init__(self, app: ASGIApp, engines: Engines) -> None:
        self.app = app
        self.engines = engines

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = PATH.fullmatch(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if match is None or not _is_json(scope):
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
            async with self.engines.use(match["index"]) as engine:
                response = await search_one(engine, request, options)
        except EspnError as exc:
            answer = library_error_response(request, exc)
            if answer is None:
                raise  # a bug stays a bug: uvicorn answers 500 without a traceback and logs it
            response = answer
        await response(scope, receive, send)
