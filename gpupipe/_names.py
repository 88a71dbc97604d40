"""File names as gpupipe writes them (``skipped.txt``, reports, JSON, messages): one line each, valid UTF-8.

A file name on Linux is any bytes but ``/`` and NUL: it may not be UTF-8 (Python hands it over with surrogates,
``'\\udcff'``, which no UTF-8 writer accepts) and may hold a newline or a tab, which would split a record. Names are
written escaped as Python writes string literals: an undecodable byte as ``\\xff``, a control character as ``\\n``,
``\\t``, ``\\r``, ``\\x1b`` or ``\\u0085``, and a backslash as ``\\\\``; every other character as it is.
:func:`unescape` gives the name back exactly.
"""

from __future__ import annotations

import os
import re

_SIMPLE = {"\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
_NEEDS = re.compile(r"[\\\x00-\x1f\x7f-\x9f\u2028\u2029\udc80-\udcff]")  # what the escaping changes


def _one(match: re.Match) -> str:
    c = match.group()
    if c in _SIMPLE:
        return _SIMPLE[c]
    code = ord(c)
    if 0xDC80 <= code <= 0xDCFF:  # os.fsdecode's stand-in for an undecodable byte
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x80 else f"\\u{code:04x}"  # \\x80 and up name undecodable bytes only


def escape(name: str | bytes | os.PathLike) -> str:
    """``name`` as one line of valid UTF-8 (module docstring); a plain name comes back unchanged."""
    text = os.fsdecode(name)
    return _NEEDS.sub(_one, text)


_ESCAPE = re.compile(r"\\(\\|n|t|r|x[0-9a-f]{2}|u[0-9a-f]{4})")


def _back(match: re.Match) -> str:
    code = match.group(1)
    if code == "\\":
        return "\\"
    if code in ("n", "t", "r"):
        return {"n": "\n", "t": "\t", "r": "\r"}[code]
    value = int(code[1:], 16)
    if code[0] == "x" and value >= 0x80:
        return chr(0xDC00 + value)  # an undecodable byte: the surrogate os functions take
    return chr(value)


def unescape(text: str) -> str:
    """The name :func:`escape` wrote, as the ``str`` that ``open``/``os`` functions take (``os.fsencode`` gives its
    bytes)."""
    return _ESCAPE.sub(_back, text)


_LINE_BREAKS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\udc80-\udcff]")


def one_line(text: str) -> str:
    """A message as one printable line: control characters and undecodable bytes escaped as :func:`escape` does,
    backslashes left as they are (a message is read, not parsed back)."""
    return _LINE_BREAKS.sub(_one, text)
