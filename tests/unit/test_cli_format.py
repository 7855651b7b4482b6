"""kvstore_cli.formatting: parsing and rendering helpers of the CLI (no daemon)."""

from __future__ import annotations

import re
from datetime import timezone

import pytest

from kvstore_cli.formatting import (
    close_namespaces,
    format_duration,
    format_percent,
    format_table,
    format_timestamp,
    missing_namespace_hint,
    parse_duration,
    parse_hash,
    parse_hash_prefix,
    parse_namespace,
    parse_token_ids,
    render_namespace,
    short_hash,
)
from kvstore_client.hashing import connector_block_size, connector_hash_root


# ---- namespaces ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ns", b"ns"),
        ("tenant/llama-3", b"tenant/llama-3"),
        ("模型", "模型".encode()),
        ("0x6e73", b"ns"),
        ("0XFF00", b"\xff\x00"),
        ("0xff00", b"\xff\x00"),
    ],
)
def test_parse_namespace(text: str, expected: bytes) -> None:
    assert parse_namespace(text) == expected


@pytest.mark.parametrize("text", ["", "0x", "0xzz", "0xabc"])
def test_parse_namespace_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="namespace"):
        parse_namespace(text)


@pytest.mark.parametrize(
    ("namespace", "expected"),
    [
        (b"ns", "ns"),
        ("模型".encode(), "模型"),
        (b"\xff\x00", "0xff00"),
        (b"a\nb", "0x610a62"),  # decodable but not printable
        (b"a\x00", "0x6100"),
        (b"0xab", "0x30786162"),  # text that would read as hex is shown as hex
    ],
)
def test_render_namespace(namespace: bytes, expected: str) -> None:
    assert render_namespace(namespace) == expected


@pytest.mark.parametrize(
    "namespace", [b"ns", b"\xff", b"\x00", b"0x", b"0X12", b"with space", "é".encode(), bytes(range(256))]
)
def test_render_namespace_round_trips(namespace: bytes) -> None:
    assert parse_namespace(render_namespace(namespace)) == namespace


# ---- hashes ----------------------------------------------------------------------------
def test_parse_hash_and_short_hash() -> None:
    digest = bytes(range(32))
    assert parse_hash(digest.hex()) == digest
    assert parse_hash(digest.hex().upper()) == digest
    assert short_hash(digest) == digest.hex()[:16]


@pytest.mark.parametrize(
    ("text", "message"), [("ab" * 31, "64 hex digits"), ("zz" * 32, "not hex"), ("", "64")]
)
def test_parse_hash_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_hash(text)


@pytest.mark.parametrize("text", ["abcd", "ABCD12", "0" * 16, "ab" * 32, " 3f2a9c "])
def test_parse_hash_prefix_takes_4_to_64_hex_digits(text: str) -> None:
    assert parse_hash_prefix(text) == text.strip().lower()


@pytest.mark.parametrize(
    ("text", "message"),
    [("abc", "at least 4"), ("ab" * 32 + "0", "64 hex digits"), ("", "got 0 characters"),
     ("abcz", "not hex"), ("0xabcd", "not hex")],
)  # fmt: skip
def test_parse_hash_prefix_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_hash_prefix(text)


# ---- namespaces that hold no blocks ----------------------------------------------------------
CONNECTOR = b"kvc2|org/model|bfloat16|bs16|kvh8|hd128|mha|cuda"
STORED = [CONNECTOR + b"|pp0of2", CONNECTOR + b"|pp1of2", b"chat", b"code-llama", b"\xff\x00bin"]


def test_close_namespaces_of_a_typo_and_of_a_missing_stage_suffix() -> None:
    assert close_namespaces(b"chta", STORED) == [b"chat"]
    assert close_namespaces(b"code-lama", STORED) == [b"code-llama"]
    # a connector namespace without its |ppRofN: the ones that extend it come first
    assert close_namespaces(CONNECTOR, STORED)[:2] == [CONNECTOR + b"|pp0of2", CONNECTOR + b"|pp1of2"]
    assert close_namespaces(b"chat", STORED, n=1) == [b"chat"]  # (the caller knows it holds nothing)
    assert close_namespaces(b"completely-else", STORED) == []
    assert close_namespaces(b"chat", []) == []


def test_missing_namespace_hint() -> None:
    assert missing_namespace_hint(b"chta", STORED) == "namespace chta holds no blocks; did you mean chat?"
    assert missing_namespace_hint(CONNECTOR, STORED[:1]) == (
        f"namespace '{CONNECTOR.decode()}' holds no blocks; did you mean '{CONNECTOR.decode()}|pp0of2'?"
    )
    many = [f"model-{i}".encode() for i in range(7)]
    assert missing_namespace_hint(b"zzz", many) == (
        "namespace zzz holds no blocks; the namespaces stored are model-0, model-1, model-2, model-3, "
        "model-4 and 2 more (kvstore-cli ls)"
    )
    assert missing_namespace_hint(b"zzz", [b"\xff\x00bin"]).endswith("are 0xff0062696e (kvstore-cli ls)")
    assert "the daemon stores nothing" in missing_namespace_hint(b"chat", [])


# ---- durations -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90.0),
        ("15m", 900.0),
        ("2h", 7200.0),
        ("7d", 604800.0),
        ("3600", 3600.0),
        ("0", 0.0),
        ("1.5h", 5400.0),
        ("2H", 7200.0),
        (" 10 s ", 10.0),
        (".5m", 30.0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "s", "5x", "-5", "1h30m", "inf", "nan", "5 minutes", "1e3"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.9, "0s"),
        (-5, "0s"),  # clock skew between hosts never shows a negative age
        (45, "45s"),
        (59.99, "59s"),
        (60, "1m"),
        (125, "2m 5s"),
        (3600, "1h"),
        (7201, "2h"),  # two most significant units only
        (7260, "2h 1m"),
        (93784, "1d 2h"),
        (86400 * 10 + 5, "10d"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_format_duration_reads_back() -> None:
    for text in ("45s", "2m", "3h", "7d"):
        assert format_duration(parse_duration(text)) == text


# ---- timestamps and percentages ------------------------------------------------------
def test_format_timestamp() -> None:
    assert format_timestamp(1_700_000_000.25, timezone.utc) == "2023-11-14 22:13:20"
    assert format_timestamp(0) == "-"
    assert len(format_timestamp(1_700_000_000)) == len("2023-11-14 22:13:20")  # local time


@pytest.mark.parametrize(
    ("part", "whole", "text"),
    [(1, 4, "25.0%"), (0, 10, "0.0%"), (10, 10, "100.0%"), (1, 100_000, "<0.1%"), (1, 0, "-")],
)
def test_format_percent(part: int, whole: int, text: str) -> None:
    assert format_percent(part, whole) == text


# ---- tables ----------------------------------------------------------------------------
def test_format_table_aligns_columns() -> None:
    text = format_table(
        [("ns", 5, "1.0 KiB"), ("longer-name", 12345, "12 B")], ("NAME", "N", "SIZE"), right={1}
    )
    assert text.splitlines() == [
        "NAME             N  SIZE",
        "ns               5  1.0 KiB",
        "longer-name  12345  12 B",
    ]


def test_format_table_without_headers_is_two_columns() -> None:
    text = format_table([("blocks", 3), ("checksum failures", 0)])
    assert text.splitlines() == ["blocks             3", "checksum failures  0"]


def test_format_table_edge_cases() -> None:
    assert format_table([]) == ""
    assert format_table([], ("A", "B")) == "A  B"
    ragged = format_table([("a",), ("bb", "c")])
    assert ragged.splitlines() == ["a", "bb  c"]  # short rows padded, no trailing spaces
    assert all(line == line.rstrip() for line in format_table([("x", "")], ("H", "LAST")).splitlines())


# ---- explain's inputs -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("1 2 3", [1, 2, 3]),
        ("1,2,3", [1, 2, 3]),
        (" 1, 2 ,3\n4\t5 \n", [1, 2, 3, 4, 5]),
        ("[1, 2, 3]", [1, 2, 3]),
        ("\n [0, 4294967295] \n", [0, 4294967295]),
    ],
)
def test_parse_token_ids(text: str, tokens: list[int]) -> None:
    assert parse_token_ids(text) == tokens


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no token ids"),
        (" ,\n", "no token ids"),
        ("[]", "no token ids"),
        ("1 two 3", "not a token id: 'two'"),
        ("1.5", "not a token id"),
        ("-1", "outside 0..4294967295"),
        ("4294967296", "outside"),
        ("[1, 2.0]", "flat list of integer"),
        ("[true]", "flat list of integer"),
        ('{"a": 1}', "not a token id"),
        ("[1, 2", "invalid JSON"),
    ],
)
def test_parse_token_ids_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_token_ids(text)


def test_connector_namespaces_hash_from_their_stage_free_root() -> None:
    from kvstore_connector.config import NamespaceInfo  # needs no vLLM

    info = NamespaceInfo("org/model|odd", "bfloat16", 16, 8, 128, False, "cpu", tp_size=2, pp_size=2)
    for namespace in info.all_namespaces():
        assert connector_hash_root(namespace) == info.hash_root.encode()
        assert connector_block_size(namespace) == 16
    # the namespaces of the kvc1 layout (one per tensor-parallel rank) are still explained
    old = info.hash_root.replace("kvc2|", "kvc1|") + "|tp1of2|pp0of1"
    assert connector_hash_root(old.encode()) == info.hash_root.replace("kvc2|", "kvc1|").encode()
    for other in (b"my-model", info.hash_root.encode(), b"\xff\xfe", b"kvc1|m|tp0of1", b"kvc2|m|tp0of1"):
        assert connector_hash_root(other) is None
        assert connector_block_size(other) is None
