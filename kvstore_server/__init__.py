"""kvstore-server: a KV-cache store daemon with a gRPC API (see protos/kvstore/v1/kvstore.proto)."""

__version__ = "0.1.0"
