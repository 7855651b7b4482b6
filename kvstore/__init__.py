"""Generated protobuf and gRPC code for the kvstore API (see protos/)."""
