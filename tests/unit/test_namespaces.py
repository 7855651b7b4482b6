"""kvstore.namespaces: the connector's namespace format, written and read back."""

from __future__ import annotations

import re

import pytest

from kvstore.namespaces import ConnectorNamespace, format_namespace, format_root, parse_namespace

FORMAT = "kvc2|MODEL|KV_DTYPE|bsN|kvhN|hdN|mla-or-mha|DEVICE[|fp8 or |int8]|ppRofN"
ROOT = format_root("org/model|odd", "bfloat16", 16, 8, 128, False, "cuda")


def test_the_root_spells_the_format() -> None:
    assert ROOT == "kvc2|org/model|odd|bfloat16|bs16|kvh8|hd128|mha|cuda"
    assert format_root("m", "fp8", 64, 1, 576, True, "cpu") == "kvc2|m|fp8|bs64|kvh1|hd576|mla|cpu"


@pytest.mark.parametrize("compression", ["none", "fp8", "int8"])
@pytest.mark.parametrize(("pp_rank", "pp_size"), [(0, 1), (1, 2), (11, 12)])
def test_a_namespace_reads_back_as_it_was_written(compression: str, pp_rank: int, pp_size: int) -> None:
    namespace = format_namespace(ROOT, compression, pp_rank, pp_size)
    parts = parse_namespace(namespace)
    assert parts == ConnectorNamespace(ROOT, 16, compression, pp_rank, pp_size)
    assert format_namespace(parts.root, parts.compression, parts.pp_rank, parts.pp_size) == namespace


def test_the_codec_is_part_of_the_namespace_not_of_the_root() -> None:
    assert format_namespace(ROOT, "none", 0, 1) == ROOT + "|pp0of1"
    assert format_namespace(ROOT, "fp8", 0, 1) == ROOT + "|fp8|pp0of1"


def test_kvc1_namespaces_still_read_without_their_tensor_parallel_rank() -> None:
    old = ROOT.replace("kvc2|", "kvc1|")
    assert parse_namespace(old + "|tp1of2|pp0of1") == ConnectorNamespace(old, 16, "none", 0, 1)


def test_an_unknown_codec_is_not_written() -> None:
    with pytest.raises(ValueError, match="compression must be none or one of fp8, int8, not 'zstd'"):
        format_namespace(ROOT, "zstd", 0, 1)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "my-model",
        ROOT,  # a root without its stage
        ROOT + "|zstd|pp0of1",
        ROOT + "|tp0of1|pp0of1",  # kvc2 has no tensor-parallel rank
        ROOT.replace("kvc2|", "kvc1|") + "|pp0of1",  # kvc1 had one
        ROOT.replace("kvc2|", "kvc1|") + "|fp8|tp0of1|pp0of1",  # and no codec
        ROOT.replace("|bs16|", "|bsx|") + "|pp0of1",
        ROOT.replace("|mha|", "|gqa|") + "|pp0of1",
        "kvc2|m|tp0of1",
        ROOT + "|pp0of1\n",
    ],
)
def test_anything_else_is_refused_naming_the_format(bad: str) -> None:
    with pytest.raises(
        ValueError, match=re.escape(f"{bad!r} is not a connector namespace: expected {FORMAT}")
    ):
        parse_namespace(bad)
