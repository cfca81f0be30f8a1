"""The daemon, by capability: dht/, averaging/, statesync/, training/ (the peer lifecycle and
one strategy per algorithm), server/, runtime/, cli/, chaos/; docs/architecture.md maps them."""
