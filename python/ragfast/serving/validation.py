"""Strict checks of a request body, before it joins a batch: a failure names the field or limit.

Every request to ``serve-retriever`` or ``serve-judge`` is validated on its own: strict JSON
types, finite numbers, text that encodes as UTF-8, size limits. A :class:`RequestError` carries
the HTTP status (4xx) its app answers with.
"""
from __future__ import annotations

import json
from typing import Any

__all__ = ["RequestError", "parse_json_body", "check_int", "check_bool", "check_text", "check_text_list",
           "json_bytes"]


class RequestError(Exception):
    """A request the server refuses: an HTTP status (4xx) and a message naming the field or limit."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = int(status)
        self.message = message


def _no_constant(name: str) -> Any:
    raise RequestError(422, f"the body holds {name}: JSON numbers must be finite")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Parse a request body as one JSON object; NaN/Infinity and non-objects are refused (422)."""
    try:
        text = raw.decode("utf-8")  # strictly: json.loads would guess UTF-16/32 from the bytes
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"the body is not UTF-8: {exc.reason} at byte {exc.start}") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except RequestError:
        raise
    except ValueError as exc:  # JSONDecodeError and friends
        raise RequestError(400, f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise RequestError(400, "the body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise RequestError(422, f"the body must be a JSON object, got {_json_type(body)}")
    return body


def _json_type(x: Any) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "a boolean"
    if isinstance(x, int):
        return "an integer"
    if isinstance(x, float):
        return "a number"
    if isinstance(x, str):
        return "a string"
    if isinstance(x, list):
        return "a list"
    return "an object"


def check_int(value: Any, name: str, *, lo: int, hi: int) -> int:
    """``value`` as a JSON integer within ``[lo, hi]`` (booleans, strings and 3.0 are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(422, f"{name} must be an integer, got {_json_type(value)}")
    if not lo <= value <= hi:
        raise RequestError(422, f"{name} must be between {lo} and {hi}, got {value}")
    return value


def check_bool(value: Any, name: str) -> bool:
    """``value`` as a JSON boolean (``1`` and ``"true"`` are refused)."""
    if not isinstance(value, bool):
        raise RequestError(422, f"{name} must be true or false, got {_json_type(value)}")
    return value


def check_text(value: Any, name: str, *, max_chars: int, limit_name: str) -> str:
    """A JSON string that UTF-8 can encode (no lone surrogates) and at most ``max_chars`` long."""
    if not isinstance(value, str):
        raise RequestError(422, f"{name} must be a string, got {_json_type(value)}")
    if len(value) > max_chars:
        raise RequestError(413, f"{name} has {len(value)} characters; the limit is {max_chars} ({limit_name})")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        # Valid JSON ("\ud800") but no tokenizer accepts it: refuse it here, alone.
        raise RequestError(422, f"{name} holds text that cannot be encoded ({exc.reason} at "
                                f"character {exc.start})") from None
    return value


def check_text_list(value: Any, name: str, *, max_items: int, items_limit: str, max_chars: int,
                    chars_limit: str, item_name: str) -> list[str]:
    """A JSON list of at most ``max_items`` strings, each checked by :func:`check_text`."""
    if not isinstance(value, list):
        raise RequestError(422, f"{name} must be a list of strings, got {_json_type(value)}")
    if len(value) > max_items:
        raise RequestError(413, f"too many {item_name} in {name}: {len(value)} > {max_items} ({items_limit})")
    return [check_text(v, f"{name}[{i}]", max_chars=max_chars, limit_name=chars_limit) for i, v in enumerate(value)]


def json_bytes(obj: Any) -> bytes:
    """Exactly the bytes of Starlette's ``JSONResponse(obj)`` body."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")
