"""The bare peer: its own gRPC service (ping, tensor put/get), the address it advertises, and
`swarmd serve`. Every daemon serves this beside the services of its capabilities."""
