"""Sizes as people write them, and back: parse_size ("512MiB" -> 536870912), format_size
(536870912 -> "512.0 MiB"), and attach_values for size flags whose value starts with '-'.

Defined once for every side that reads or prints sizes: the daemon's config and flags,
kvstore-cli and the benches. Imports nothing of the daemon or the client.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
SIZE_FORMS = "use a number of bytes or a number with B, KiB, MiB, GiB, TiB, KB, MB, GB, TB: 512MiB, 16GiB"
"""What parse_size accepts, as its errors say it."""


def parse_size(value: str | int, what: str = "") -> int:
    """'512MiB' -> 536870912. Binary units (KiB, MiB, GiB, TiB; K, M, G, T), decimal KB/MB/GB/TB.

    Raises ValueError naming the value and the forms accepted (SIZE_FORMS), after `what`
    (the flag or setting it came from) when given: "--memory: invalid size 'lots' (...)".
    """
    where = f"{what}: " if what else ""
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{where}invalid size {value}: a size must not be negative ({SIZE_FORMS})")
        return value
    if value.strip().startswith("-"):
        raise ValueError(f"{where}invalid size {value!r}: a size must not be negative ({SIZE_FORMS})")
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{where}invalid size {value!r} ({SIZE_FORMS})")
    return int(float(match.group(1)) * _UNITS[unit])


def attach_values(argv: Sequence[str], flags: Collection[str]) -> list[str]:
    """`argv` with each of `flags` followed by a value that starts with '-' joined to it:
    `--memory -1GiB` becomes `--memory=-1GiB`.

    NOTE: argparse reads `-1GiB` as an option and stops with "expected one argument" and
    its whole usage; joined, the value reaches its parser, which says what is wrong with it.
    Only a '-' then a digit or '.' is taken as a value: an option after the flag stays one.
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        following = argv[i + 1] if i + 1 < len(argv) else ""
        if arg in flags and re.match(r"-[\d.]", following):
            out.append(f"{arg}={following}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover
