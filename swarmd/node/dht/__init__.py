"""The DHT: Kademlia over the swarmd transport, with signed, expiring records.

Peers find each other, the run's configuration, roles and progress only through it. See
node.py for the API the rest of the daemon uses (DHTNode.store/get/announce/watch).
"""

from swarmd.node.dht.config import DHTConfig
from swarmd.node.dht.node import BootstrapError, DHTNode, KeyReader, open_dht
from swarmd.node.dht.records import Record, RecordError, RecordLimits
from swarmd.node.dht.values import Value

__all__ = [
    "BootstrapError",
    "DHTConfig",
    "DHTNode",
    "KeyReader",
    "Record",
    "RecordError",
    "RecordLimits",
    "Value",
    "open_dht",
]
