"""Averaging between peers: matchmaking a group through the DHT, the fault-tolerant all-reduce
over the bulk plane, and the reduction (weighted or robust) each reducer applies to its part."""
