"""SWARM (Ryabinin et al. 2023): pipeline stages served by peers, trainers that route each
micro-batch through one server per stage, servers that rebalance to the slowest stage and
average within their stage, and CheckFree/CheckFree+ rebuilding a lost stage (recovery.py,
copies.py). Everything SWARM does on a peer is in this package; its math is
swarmd/optim/stage.py and swarmd/optim/checkfree.py."""
