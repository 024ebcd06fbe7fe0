"""espn_client: a typed client (sync and async) for the espn search service.

    from espn_client import Client

    espn = Client("http://localhost:8000", api_key="...")
    for hit in espn.search("what causes ocean tides", k=5, return_text=True).results:
        print(hit.id, hit.score, hit.title)

Its dependencies are httpx and pydantic. The retrievers for LangChain, LlamaIndex and
Haystack are the modules `espn_client.langchain`, `espn_client.llama_index` and
`espn_client.haystack`, each behind an extra (`pip install 'espn-client[langchain]'`);
importing `espn_client` imports none of them.
"""

from ._core import DEFAULT_TIMEOUT_S, RetryPolicy
from ._exchange import DEFAULT_DEADLINE_S, DEFAULT_MAX_ANSWER_BYTES, MAX_ERROR_BODY_BYTES
from .async_client import AsyncClient
from .client import Client
from .errors import (ApiError, BadRequestError, ConflictError, DeadlineExceededError, EspnError, ForbiddenError,
                     InsufficientStorageError, InvalidRequestError, MalformedResponseError, MethodNotAllowedError,
                     MisdirectedRequestError, NotFoundError, PayloadTooLargeError, RequestTimeoutError,
                     ResponseError, ResponseTooLargeError, TooManyRequestsError, TransportError, UnauthorizedError,
                     UnavailableError)
from .models import (BatchSearchRequest, BatchSearchResponse, BatchWriteRequest, Document, DocumentUpsert,
                     DocumentWrite, ErrorBody, Explanation, Health, LexicalMatch, PassageSpan, QueryError, Readiness,
                     SearchHit, SearchParams, SearchRequest, SearchResponse, SearchStats, ServerLimits, SnapshotInfo,
                     SnapshotList, IndexInfo, IndexList, SnapshotRequest, TokenMatch, WriteResponse,
                     CreateIndexRequest)

__version__ = "0.1.0"

__all__ = [
    "Client", "AsyncClient", "RetryPolicy",
    "DEFAULT_TIMEOUT_S", "DEFAULT_DEADLINE_S", "DEFAULT_MAX_ANSWER_BYTES", "MAX_ERROR_BODY_BYTES",
    "EspnError", "TransportError", "RequestTimeoutError", "DeadlineExceededError", "ResponseError",
    "ResponseTooLargeError", "MalformedResponseError", "ApiError", "BadRequestError", "UnauthorizedError",
    "ForbiddenError", "NotFoundError", "MethodNotAllowedError", "ConflictError", "MisdirectedRequestError",
    "PayloadTooLargeError", "InvalidRequestError", "TooManyRequestsError", "UnavailableError",
    "InsufficientStorageError",
    "SearchParams", "SearchRequest", "BatchSearchRequest", "DocumentWrite", "DocumentUpsert", "BatchWriteRequest",
    "SnapshotRequest", "PassageSpan", "TokenMatch", "Explanation", "LexicalMatch", "SearchHit", "SearchStats",
    "SearchResponse", "QueryError", "BatchSearchResponse", "Document", "WriteResponse", "Health", "Readiness",
    "SnapshotInfo", "SnapshotList", "IndexInfo", "IndexList", "ErrorBody", "ServerLimits", "CreateIndexRequest",
]
