"""Run files tests write to run.toml, one per algorithm: tiny models, so that real `swarmd
join` processes get through their rounds in seconds. A test that needs a variant edits one
with str.replace, so each setting below is on a line of its own."""

from __future__ import annotations

# Six rounds of H=5 are too few for the paper's outer momentum 0.9 to warm up: it overshoots
# (seen: validation loss 5.5 -> 3.2 -> 6.9 under CI load). 0.5 still exercises Nesterov momentum.
TINY_RUN = """\
n_layer = 1
n_head = 2
n_embd = 32
block_size = 32
batch_size = 4
inner_steps = 5
inner_lr = 0.003
outer_momentum = 0.5
min_group_size = 2
"""

DEMO_RUN = TINY_RUN.replace("min_group_size = 2", "min_group_size = 3") + (
    'algo = "demo"\ndemo_topk = 8\ndemo_chunk = 16\n'
)

# H=4 in P=2 fragments: a fragment round every 2 inner steps, begun 1 step early (τ=1).
STREAMING_RUN = (
    TINY_RUN.replace("inner_steps = 5", "inner_steps = 4")
    + 'algo = "streaming-diloco"\nfragments = 2\noverlap_steps = 1\nmix_alpha = 0.5\n'
)

#: SWARM's stage round period in the runs below (seconds).
SWARM_ROUND_S = 3.0
#: SWARM, the pipeline: 3 layers on 3 stages, a stage round every 3 s, no rebalancing.
SWARM_RUN = f"""\
n_layer = 3
n_head = 2
n_embd = 32
block_size = 32
batch_size = 4
inner_lr = 0.003
data_shards = 4
algo = "swarm"
swarm_stages = 3
swarm_round_s = {SWARM_ROUND_S}
swarm_rebalance_s = 0
"""
