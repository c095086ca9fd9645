"""What may be written to a jsonb column, decided in Python before the database sees it.

PostgreSQL's jsonb refuses NaN and the infinities (not JSON), the NUL character (``\\u0000``) and
lone UTF-16 surrogates; Python's ``json`` module produces all of them without complaint. A statement
carrying one fails as a whole, so one task returning ``float("nan")`` would otherwise fail the batch
that finishes its neighbours too. Values are therefore checked here, and:

- a *result* that cannot be stored fails its attempt (:class:`~tasks.exceptions.UnstorableResult`),
  saying why; it is not retried, since running the handler again repeats its side effects only to
  produce the same value;
- *error text* (messages, tracebacks, class paths) is made storable without losing information: NUL
  becomes the four characters ``\\x00`` and a lone surrogate its ``\\udXXX`` escape; a very long
  traceback keeps its head and tail.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tasks.exceptions import UnstorableResult

#: A JSON ``\u0000`` escape that is not itself an escaped backslash followed by ``u0000``.
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")

#: Longest stored error message and traceback (characters); longer ones keep their head and tail.
MAX_MESSAGE = 10_000
MAX_TRACEBACK = 16_000  # x MAX_ERRORS (10) entries: a row's error history stays under ~200 KB


#: One encoder for every value (``json.dumps`` with arguments builds a new one per call).
_ENCODER = json.JSONEncoder(allow_nan=False, ensure_ascii=False)


def storable_json(value: Any) -> str:
    """``value`` as JSON text that jsonb accepts, or :class:`UnstorableResult` saying why not."""
    try:
        text = _ENCODER.encode(value)
    except (TypeError, ValueError, RecursionError, OverflowError) as exc:
        raise UnstorableResult(f"not JSON-serialisable: {storable_text(str(exc))}") from None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UnstorableResult("contains a lone surrogate (not valid Unicode)") from None
    if "\\u0000" in text and _NUL_ESCAPE.search(text):
        raise UnstorableResult("contains a NUL character, which PostgreSQL cannot store") from None
    return text


def storable_text(text: str, limit: int | None = None) -> str:
    """``text`` with NUL and lone surrogates escaped (nothing dropped), cut to ``limit`` characters."""
    if not isinstance(text, str):
        text = repr(text)
    text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if limit is not None and len(text) > limit:
        head = limit * 3 // 4
        tail = limit - head
        text = f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[-tail:]}"
    return text


def is_storable(value: Any) -> bool:
    try:
        storable_json(value)
    except UnstorableResult:
        return False
    return True
