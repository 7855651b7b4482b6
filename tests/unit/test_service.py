"""kvstore.service: the names both sides use match the proto they speak."""

from __future__ import annotations

from kvstore.service import SERVICE_NAME, SERVICE_PREFIX
from kvstore.v1 import kvstore_pb2 as pb


def test_the_service_name_is_the_protos() -> None:
    service = pb.DESCRIPTOR.services_by_name["KVStore"]
    assert SERVICE_NAME == service.full_name
    assert SERVICE_PREFIX + "Lookup" == f"/{service.full_name}/{service.methods_by_name['Lookup'].name}"
