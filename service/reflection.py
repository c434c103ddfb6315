"""gRPC server reflection, v1 and v1alpha (grpcurl, Postman, grpc-js tools ask for either).

grpcio-reflection ships the v1alpha service only. ``grpc.reflection.v1`` has the same messages with the same
field numbers (only the package differs), so the v1 service is the v1alpha servicer registered under the v1 name:
the bytes on the wire are those of v1.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA_SERVICE = reflection.SERVICE_NAME  # "grpc.reflection.v1alpha.ServerReflection"
V1_SERVICE = "grpc.reflection.v1.ServerReflection"


def enable_reflection(server: grpc.Server, service_names: Sequence[str]) -> None:
    """Serve reflection for ``service_names`` (plus both reflection services) under v1 and v1alpha."""
    names = (*service_names, V1_SERVICE, V1ALPHA_SERVICE)
    servicer = reflection.ReflectionServicer(names)
    for service in (V1ALPHA_SERVICE, V1_SERVICE):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString),
        }),))
