"""Byte counters by RPC method: what benchmarks use to say where bytes beyond payloads go."""

from __future__ import annotations

from swarmd.node.metrics import Metrics

FIND = "/swarmd.dht.v1.DHT/Find"
PUT = "/swarmd.averaging.v1.Averager/PutPart"


def test_bytes_are_counted_by_method_and_in_total() -> None:
    m = Metrics()
    m.on_bytes(FIND, 300, 1000)
    m.on_bytes(PUT, 5000, 10)
    m.on_bytes(FIND, 200, 0)
    m.on_bytes(PUT, 0, 7)  # received only: no sent entry grows
    assert (m.sent_total, m.received_total) == (5500, 1017)
    assert m.sent_by_method == {FIND: 500, PUT: 5000}
    text = m.render().decode()
    assert f'swarmd_sent_bytes_total{{method="{FIND}"}} 500.0' in text
    assert f'swarmd_received_bytes_total{{method="{PUT}"}} 17.0' in text


def test_sent_since_a_snapshot_names_methods_briefly() -> None:
    m = Metrics()
    m.on_bytes(FIND, 100, 0)
    before = dict(m.sent_by_method)
    m.on_bytes(FIND, 40, 0)
    m.on_bytes(PUT, 2000, 0)
    assert m.sent_since(before) == {"Find": 40, "PutPart": 2000}
    assert m.sent_since(dict(m.sent_by_method)) == {}
