"""Codecs for what crosses the network: pure functions on tensors and bytes, no I/O."""
