"""Generated protobuf and gRPC stubs for ``protos/kvgrid/v1`` (regenerate with ``make protos``)."""
