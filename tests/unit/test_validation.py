"""kvstore_server.rpc.validation: request fields checked at the edge."""

from __future__ import annotations

import pytest

from kvstore.v1 import kvstore_pb2 as pb
from kvstore_server.errors import InvalidRequest
from kvstore_server.rpc.validation import check_layers, check_record_size


def specs(rows: list[tuple[str, str, list[int]]]) -> list[pb.LayerSpec]:
    return [pb.LayerSpec(name=name, dtype=dtype, shape=shape) for name, dtype, shape in rows]


def test_a_layout_sent_again_is_the_one_checked_before_and_a_bad_one_is_refused_every_time() -> None:
    rows = [(f"layer.{i}#h{j}", "bfloat16", [16, 128]) for i in range(4) for j in range(8)]
    first = check_layers(specs(rows))
    want = [(name, dtype, tuple(shape), 4096) for name, dtype, shape in rows]
    assert [(s.name, s.dtype, s.shape, s.nbytes) for s in first] == want
    assert check_layers(specs(rows)) is first  # the same (interned) tuple, not checked again
    other = check_layers(specs([*rows[:-1], (rows[-1][0], "float32", [16, 128])]))
    assert other is not first and other[-1].nbytes == 8192
    bad = specs([*rows, (rows[0][0], "bfloat16", [16, 128])])  # a name repeated
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="repeated"):
            check_layers(bad)
    with pytest.raises(InvalidRequest, match="unsupported dtype"):
        check_layers(specs([("x", "complex32", [4])]))


def test_a_record_larger_than_its_data_is_refused_each_time_and_a_fitting_one_never() -> None:
    small = check_layers(specs([(f"l{i}", "bfloat16", [16, 128]) for i in range(8)]))
    bloated = check_layers(specs([(f"{'n' * 200}.{i}", "bool", [1]) for i in range(64)]))
    for _ in range(2):  # the second time from what the first measured
        check_record_size(b"ns", b"h" * 32, small)
        with pytest.raises(InvalidRequest, match="names and specs take .* bytes per block"):
            check_record_size(b"ns", b"h" * 32, bloated)
    with pytest.raises(InvalidRequest, match="names and specs"):  # a longer namespace: measured anew
        check_record_size(b"n" * 200, b"h" * 32, bloated)
