"""One package per training algorithm, each holding its strategy, its wire, its services and
its recovery; registry.py maps a run config's `algo` to one. loop.py is the outer loop the
DiLoCo family and DeMo share. The math is in swarmd/optim and swarmd/compression."""
