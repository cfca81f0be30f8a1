"""What tests share, and nothing else of tests/ is imported by a test module: each test
module imports from here (and from swarmd, the standard library and third-party packages)
only, so it can be read, run and moved alone. Modules here may import each other.

Shared helpers, one idea a module:

- processes: child processes that print JSON lines (`Proc`, `ProcessGroup`, `swarmd_cmd`),
  `ROOT` and `HARNESS` (this folder, where the programs below are started from by path);
- join: `swarmd join` peers: a bootstrap node, their command lines, reading their events;
- runs: the run files tests create, one per algorithm (TINY_RUN, DEMO_RUN, STREAMING_RUN,
  SWARM_RUN);
- swarm: SWARM, the pipeline algorithm: stage servers, trainers, three stages ready to train;
- allreduce: four allreduce_peer.py processes, their rounds and the exact mean they must give;
- matchmaking: in-process peers meeting through a real DHT, each serving an Averager;
- clients: client-mode members (an address nobody answers);
- transport: a server's bulk-plane hello, and rpc_test_server.py's command line;
- diloco: DiLoCo's optimiser without the network (a tiny GPT, in-memory averages);
- batches: seeded random token batches;
- netns: hosts as network namespaces (deploy/netns.py): their run, fixture and events;
- docker_compose: driving docker and docker compose (deploy/docker-compose.yml).

Programs tests start as processes (or import a function of):

- allreduce_peer, gather_peer, statesync_donor, rpc_test_server: a real peer or server for
  one layer's tests (all-reduce, DeMo's all-gather, state sync, the transport);
- hostile_publisher: publishes hostile and odd runs in the DHT for the dashboard's tests;
- user_model: a user's own model, named by a run file;
- lying_peer, forger: `swarmd join` with one lie (forger: reducers that forge their proofs);
- attacker, attacker_peer: a stranger on the run's DHT, and a peer serving a forged state;
- netns_probe: a TCP probe run inside a network namespace.
"""
