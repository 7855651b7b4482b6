"""Pure parsing and formatting helpers of kvstore-cli: no I/O, no gRPC.

    parse_namespace("0x6e73") == b"ns"       render_namespace(b"ns") == "ns"
    parse_hash("ab" * 32)                     short_hash(h) -> first 16 hex digits
    parse_hash_prefix("3f2a9c")               a hash, or a prefix of one (as ls shows them)
    close_namespaces(b"chta", stored)         the stored namespaces it may have meant
    missing_namespace_hint(b"chta", stored)   one line saying so, for a namespace with no blocks
    parse_duration("15m") == 900.0            format_duration(93784) == "1d 2h"
    format_table(rows, headers, right={2})    aligned columns, two spaces apart
    parse_token_ids("1 2, 3") == [1, 2, 3]    also a JSON list: "[1, 2, 3]"

render_namespace and parse_namespace round-trip: whatever the CLI prints as a
namespace can be passed back to --namespace.
"""

from __future__ import annotations

import difflib
import json
import re
import shlex
from collections.abc import Iterable, Sequence
from datetime import datetime, tzinfo

HASH_HEX_DIGITS = 64
SHORT_HASH_DIGITS = 16
MIN_PREFIX_DIGITS = 4
"""The shortest hash prefix accepted (as git takes abbreviated commit ids)."""
_HEX_RE = re.compile(r"^[0-9a-f]*$")
_NAMESPACES_SHOWN = 5

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)\s*$", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_UNITS = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
MAX_TOKEN_ID = 2**32 - 1


def parse_namespace(text: str) -> bytes:
    """A namespace from the command line: UTF-8 text, or hex after a `0x` prefix."""
    if text[:2].lower() == "0x":
        try:
            value = bytes.fromhex(text[2:])
        except ValueError:
            raise ValueError(f"invalid hex namespace {text!r}") from None
    else:
        value = text.encode()
    if not value:
        raise ValueError("namespace must not be empty")
    return value


def render_namespace(namespace: bytes) -> str:
    """Printable form: the UTF-8 text when it is printable, else 0x and hex.

    Text that itself starts with `0x` is shown as hex too, so the result always
    parses back to the same bytes with parse_namespace.
    """
    try:
        text = namespace.decode()
    except UnicodeDecodeError:
        text = ""
    if text and text.isprintable() and text[:2].lower() != "0x":
        return text
    return "0x" + namespace.hex()


def parse_hash(text: str) -> bytes:
    """A block hash given as 64 hex digits."""
    if len(text) != HASH_HEX_DIGITS:
        raise ValueError(f"a block hash is {HASH_HEX_DIGITS} hex digits, got {len(text)} characters")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"invalid block hash {text!r}: not hex") from None


def parse_hash_prefix(text: str) -> str:
    """A block hash, or the leading digits of one, as lowercase hex: 64 digits name a block
    outright; from MIN_PREFIX_DIGITS up, a prefix the caller resolves (`ls` shows 16)."""
    digits = text.strip().lower()
    if not MIN_PREFIX_DIGITS <= len(digits) <= HASH_HEX_DIGITS:
        raise ValueError(
            f"a block hash is {HASH_HEX_DIGITS} hex digits, or a unique prefix of at least "
            f"{MIN_PREFIX_DIGITS} (ls shows {SHORT_HASH_DIGITS}); got {len(digits)} characters"
        )
    if not _HEX_RE.match(digits):
        raise ValueError(f"invalid block hash {text!r}: not hex")
    return digits


def short_hash(block_hash: bytes) -> str:
    return block_hash.hex()[:SHORT_HASH_DIGITS]


def shell_namespace(namespace: bytes) -> str:
    """The printed form of `namespace`, quoted for a shell where it needs it (a connector
    namespace's `|`), so it can be pasted back into --namespace."""
    return shlex.quote(render_namespace(namespace))


def close_namespaces(wanted: bytes, stored: Iterable[bytes], n: int = 3) -> list[bytes]:
    """Up to `n` of the `stored` namespaces that `wanted` may have meant, best first: those
    that extend it by a `|` part (a connector namespace pasted without its |ppRofN), then
    those whose printed forms difflib finds close (a typo)."""
    spaces = list(stored)
    extending = sorted(ns for ns in spaces if ns.startswith(wanted + b"|"))
    printed = {render_namespace(ns): ns for ns in spaces}
    close = difflib.get_close_matches(render_namespace(wanted), list(printed), n=n)
    return list(dict.fromkeys([*extending, *(printed[text] for text in close)]))[:n]


def missing_namespace_hint(wanted: bytes, stored: Sequence[bytes]) -> str:
    """One line for a namespace that holds no blocks: which stored namespaces it may have
    meant, else a few of those stored, else that the daemon holds none."""
    name = shell_namespace(wanted)
    if not stored:
        return f"namespace {name} holds no blocks, and no namespace does: the daemon stores nothing"
    close = close_namespaces(wanted, stored)
    if close:
        return f"namespace {name} holds no blocks; did you mean {' or '.join(map(shell_namespace, close))}?"
    some = ", ".join(shell_namespace(ns) for ns in stored[:_NAMESPACES_SHOWN])
    more = f" and {len(stored) - _NAMESPACES_SHOWN} more" if len(stored) > _NAMESPACES_SHOWN else ""
    return f"namespace {name} holds no blocks; the namespaces stored are {some}{more} (kvstore-cli ls)"


def parse_duration(text: str) -> float:
    """Seconds from '90s', '15m', '2h', '7d' or a plain number of seconds."""
    match = _DURATION_RE.match(text)
    if match is None:
        raise ValueError(f"invalid duration {text!r}; expected e.g. 90s, 15m, 2h, 7d or seconds")
    return float(match.group(1)) * _SECONDS[match.group(2).lower()]


def format_duration(seconds: float) -> str:
    """The two most significant units: '1d 2h', '5m 3s', '45s'; '0s' under a second."""
    remaining = max(0, int(seconds))
    values = []
    for suffix, size in _UNITS:
        value, remaining = divmod(remaining, size)
        values.append((value, suffix))
    first = next((i for i, (value, _) in enumerate(values) if value), len(values) - 1)
    return " ".join(f"{value}{suffix}" for value, suffix in values[first : first + 2] if value) or "0s"


def format_timestamp(unix_seconds: float, tz: tzinfo | None = None) -> str:
    """'2024-05-01 12:03:04' in `tz` (local time by default); '-' for 0 (unset)."""
    if unix_seconds <= 0:
        return "-"
    return datetime.fromtimestamp(unix_seconds, tz).strftime("%Y-%m-%d %H:%M:%S")


def format_percent(part: float, whole: float) -> str:
    """'25.0%'; '<0.1%' for a small non-zero share; '-' when `whole` is 0."""
    if whole <= 0:
        return "-"
    percent = 100.0 * part / whole
    return "<0.1%" if 0 < percent < 0.05 else f"{percent:.1f}%"


def format_table(
    rows: Iterable[Sequence[object]], headers: Sequence[str] | None = None, right: Iterable[int] = ()
) -> str:
    """Rows as aligned columns two spaces apart; columns in `right` are right-aligned."""
    lines = [[str(cell) for cell in row] for row in ([headers] if headers else []) + list(rows)]
    if not lines:
        return ""
    columns = max(map(len, lines))
    lines = [line + [""] * (columns - len(line)) for line in lines]
    widths = [max(len(line[i]) for line in lines) for i in range(columns)]
    right = set(right)
    out = []
    for line in lines:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]) for i, cell in enumerate(line)
        ]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def parse_token_ids(text: str) -> list[int]:
    """Token ids separated by whitespace and/or commas, or a JSON list of integers."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            values = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"invalid JSON list of token ids: {exc}") from None
        if not isinstance(values, list) or not all(type(v) is int for v in values):
            raise ValueError("the JSON must be a flat list of integer token ids")
        tokens: list[int] = values
    else:
        words = [w for w in re.split(r"[\s,]+", stripped) if w]
        try:
            tokens = [int(w) for w in words]
        except ValueError:
            bad = next(w for w in words if not w.lstrip("+-").isdigit())
            raise ValueError(f"not a token id: {bad[:40]!r}") from None
    if not tokens:
        raise ValueError("no token ids given")
    out_of_range = next((t for t in tokens if not 0 <= t <= MAX_TOKEN_ID), None)
    if out_of_range is not None:
        raise ValueError(f"token id {out_of_range} is outside 0..{MAX_TOKEN_ID}")
    return tokens
