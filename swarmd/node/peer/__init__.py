"""One peer of a run, whatever its algorithm: the lifecycle of `swarmd join` (identity, server,
DHT bootstrap, run config, access, membership, progress, local state, local ranks) and the
`Strategy` seam (strategy.py) an algorithm plugs into. Nothing here imports an algorithm."""
