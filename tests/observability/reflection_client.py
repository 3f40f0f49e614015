"""List a server's services through gRPC reflection alone, as `grpcurl list` does (no proto files)."""

from __future__ import annotations

import grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc


def list_services(addr: str, timeout: float = 10.0) -> list[str]:
    with grpc.insecure_channel(addr) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=timeout))
        return sorted(s.name for s in response.list_services_response.service)


def describe_method(addr: str, symbol: str, timeout: float = 10.0) -> list[str]:
    """Method names of ``symbol`` (a service), resolved from the descriptors the server sends."""
    from google.protobuf import descriptor_pb2

    with grpc.insecure_channel(addr) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
        (response,) = list(stub.ServerReflectionInfo(iter([request]), timeout=timeout))
        methods = []
        for raw in response.file_descriptor_response.file_descriptor_proto:
            fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
            for service in fd.service:
                if f"{fd.package}.{service.name}" == symbol:
                    methods += [m.name for m in service.method]
        return methods
