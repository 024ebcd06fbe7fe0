"""External document ids: UTF-8 strings, stored and compared byte for byte.

Ids are stored as fixed-width numpy bytes (`ids.npy`), which cannot hold a trailing NUL,
and are compared as UTF-8 bytes. So an id with a NUL or another control character, or
one that is not valid UTF-8 (raw bytes such as `%FF` in a URL, or a lone surrogate such
as `%ED%A0%80` or the JSON escape `\\ud800`), would collide with another id or could not
be stored as given. Every way in (the build's corpus reader, `espn add` and
`espn delete`, the HTTP routes) checks ids with `check_doc_id` before anything is
written, and refuses them with a message that names the problem.
"""

from __future__ import annotations

import unicodedata

from .errors import InvalidParameterError

__all__ = ["MAX_ID_BYTES", "check_doc_id", "decode_doc_id", "id_problem", "quote_id"]

#: Longest external id, in UTF-8 bytes.
MAX_ID_BYTES = 512


def id_problem(doc_id: object) -> str | None:
    """What is wrong with `doc_id` as an external id, or None when it is fine."""
    if not isinstance(doc_id, str):
        return f"must be a string, got {type(doc_id).__name__}"
    if not doc_id:
        return "is empty"
    for position, char in enumerate(doc_id):
        code = ord(char)
        if 0xD800 <= code <= 0xDFFF:
            return f"is not valid UTF-8: a lone surrogate U+{code:04X} at character {position}"
        if unicodedata.category(char) == "Cc":
            return f"contains the control character U+{code:04X} at character {position}"
    if doc_id != doc_id.strip():
        return "starts or ends with whitespace"
    size = len(doc_id.encode("utf-8"))
    if size > MAX_ID_BYTES:
        return f"is {size} UTF-8 bytes long; at most {MAX_ID_BYTES}"
    return None


def check_doc_id(doc_id: object, what: str = "document id") -> str:
    """`doc_id` when it is a valid external id; InvalidParameterError naming the problem otherwise."""
    problem = id_problem(doc_id)
    if problem is not None:
        raise InvalidParameterError(f"{what} {quote_id(doc_id)} {problem}")
    assert isinstance(doc_id, str)
    return doc_id


def decode_doc_id(raw: bytes, what: str = "document id") -> str:
    """An id given as bytes (a URL path after percent-decoding): strict UTF-8, then `check_doc_id`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        try:  # a surrogate encoded as UTF-8 (CESU-8, WTF-8): name it
            check_doc_id(raw.decode("utf-8", "surrogatepass"), what)
        except (UnicodeDecodeError, InvalidParameterError) as named:
            if isinstance(named, InvalidParameterError):
                raise named from None
        raise InvalidParameterError(f"{what} {raw!r} is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
    return check_doc_id(text, what)


def quote_id(doc_id: object) -> str:
    """The id for a message: escaped, so that control characters cannot garble a log line."""
    text = ascii(doc_id) if isinstance(doc_id, str) else repr(doc_id)
    return text if len(text) <= 80 else text[:77] + "..."
