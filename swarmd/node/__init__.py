"""The daemon. peer/ is the lifecycle every algorithm shares, algorithms/ holds one package per
algorithm (registry.py names them), and dht/, averaging/, statesync/, runtime/ and the modules
beside them are the machinery both use; cli/, chaos/ and dashboard/ sit on top.
docs/architecture.md maps them."""
