"""The wire: protobuf messages, the trio<->gRPC transport, tensor framing, identity."""
