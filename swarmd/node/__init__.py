"""The daemon: CLI, metrics, and (later) DHT, averaging, training."""
