"""The dashboard's board: churn events, gone peers, state agreement, bounded history, and the
views' JSON; plus the validation of configs and adverts read from the DHT."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from swarmd.node.dashboard import board as board_module
from swarmd.node.dashboard.board import Board
from swarmd.node.dashboard.reading import Advert, Reading, parse_advert, parse_config
from swarmd.node.dashboard.views import events_view, history_view, peers_view, run_view
from swarmd.node.dht import Value
from swarmd.node.peer.progress_record import Notice, ProgressRecord
from swarmd.node.runkeys import CONFIG_TTL_S
from swarmd.protocol import statesync_pb2
from swarmd.protocol.identity import Identity

RECORD = ProgressRecord(
    step=10,
    round=1,
    loss=3.0,
    val_loss=3.5,
    tokens_per_s=100.0,
    device="cpu",
    name="",
    sent_bytes=5,
    received_bytes=6,
    group_size=2,
    last_outer="averaged",
    algo="diloco",
    params=1000,
)


def reading(peers: dict[str, tuple[int, float | None, str]]) -> Reading:
    """peer -> (round, val loss, last outer status): each with a heartbeat and a record."""
    found = Reading()
    for peer, (round_no, val, status) in peers.items():
        found.heartbeats[peer] = "127.0.0.1:1"
        found.progress[peer] = dataclasses.replace(
            RECORD, round=round_no, val_loss=val, last_outer=status
        )
        found.adverts[peer] = Advert(round_no, f"hash{round_no}")
    return found


def test_churn_events_gone_peers_and_history() -> None:
    board = Board("r")
    board.update(reading({"a" * 52: (1, 3.5, "averaged"), "b" * 52: (1, 3.4, "averaged")}), 1.0)
    board.update(reading({"a" * 52: (2, 3.0, "averaged"), "c" * 52: (2, 3.1, "alone")}), 2.0)
    kinds = [(e["kind"], e["peer"][0]) for e in board.events]
    assert sorted(kinds[:2]) == [("joined", "a"), ("joined", "b")]  # the first poll
    assert kinds[2:] == [("joined", "c"), ("round", "c"), ("left", "b")]
    assert (
        "is in the run" in board.events[0]["text"]
        and board.events[2]["text"] == "c" * 10 + " joined"
    )
    assert board.events[3]["text"] == "c" * 10 + ": round 2 alone (group of 2)"
    rows = {row["peer_id"][0]: row for row in peers_view(board)["peers"]}
    assert [rows[p]["live"] for p in "abc"] == [True, False, True]
    history = history_view(board)
    assert history["loss"]["rounds"] == [1, 2]
    values = {s["peer_id"][0]: s["values"] for s in history["loss"]["series"]}
    assert values == {"a": [3.5, 3.0], "b": [3.4, None], "c": [None, 3.1]}
    assert history["groups"] == {"rounds": [1, 2], "sizes": [2, 2]}
    assert history["tokens"]["values"] == [200.0, 200.0]
    run = run_view(board)
    assert (run["round"], run["live_peers"], run["gone_peers"]) == (2, 2, 1)
    assert events_view(board)["events"][0]["kind"] == "left"  # newest first
    json.dumps([run, peers_view(board), history, events_view(board)], allow_nan=False)


def test_state_agreement_is_the_majority_at_the_newest_round() -> None:
    board = Board("r")
    found = reading({p * 52: (3, 3.0, "averaged") for p in "abc"})
    found.adverts["c" * 52] = Advert(3, "other")
    board.update(found)
    rows = {row["peer_id"][0]: row for row in peers_view(board)["peers"]}
    assert [rows[p]["state_agrees"] for p in "abc"] == [True, True, False]


def test_memory_is_bounded() -> None:
    board = Board("r")
    for i in range(board_module.MAX_PEERS + 50):
        board.update(reading({f"{i:052d}": (i, 1.0, "alone")}), float(i))
    assert len(board.peers) == board_module.MAX_PEERS
    assert len(board.losses) <= board_module.MAX_ROUNDS
    assert len(board.events) == board_module.MAX_EVENTS
    assert sys.getsizeof(board.tokens) < 1 << 16


def _value(raw: bytes, age: float = 10.0) -> dict[object, Value]:
    owner = Identity.generate().peer_id
    now = time.time()
    return {owner: Value(raw, now + CONFIG_TTL_S - age, owner)}


def test_parse_config_keeps_only_well_typed_printable_fields() -> None:
    raw = b'{"algo": "demo", "n_layer": NaN, "n_embd": "1", "n_head": true, "model": "a\\u0007"}'
    info, error = parse_config(_value(raw), time.time())  # type: ignore[arg-type]
    assert error == "" and info is not None
    assert info.fields == {"algo": "demo"}
    assert info.age_s is not None and 9 <= info.age_s <= 12
    for bad in (b"[]", b"{", b"\xff"):
        assert parse_config(_value(bad), time.time())[0] is None  # type: ignore[arg-type]
    assert parse_config({}, time.time()) == (None, "")


def test_parse_advert() -> None:
    good = statesync_pb2.StateAdvert(round=4, state_hash=b"\x01" * 32, address="h:1")
    assert parse_advert(good.SerializeToString()) == Advert(4, "01" * 8)
    assert parse_advert(b"\xff\xff\xff") is None
    assert parse_advert(statesync_pb2.StateAdvert(round=4).SerializeToString()) is None


def test_bytes_a_step_against_data_parallel() -> None:
    board = Board("r")
    first = reading({"a" * 52: (1, 3.5, "averaged"), "b" * 52: (1, 3.4, "averaged")})
    board.update(first, 1.0)
    assert not board.bytes and run_view(board)["bytes_ratio"] is None  # no rate yet
    later = reading({"a" * 52: (2, 3.0, "averaged"), "b" * 52: (2, 3.1, "averaged")})
    # a sent 1000 B a step over 10 steps, b 3000 B; a step with nothing new is not a sample.
    for peer, sent in (("a", 10_005), ("b", 30_005)):
        later.progress[peer * 52] = dataclasses.replace(
            later.progress[peer * 52], step=20, sent_bytes=sent
        )
    board.update(later, 2.0)
    # Data-parallel over 2 peers: 2 (n - 1) / n x 4 B x 1000 parameters = 4000 B a step.
    assert list(board.bytes) == [(2.0, 2000.0, 4000.0)]
    assert run_view(board)["bytes_ratio"] == 2.0
    assert history_view(board)["bytes"] == {"times": [2.0], "swarm": [2000.0], "ddp": [4000.0]}
    assert {p["bytes_per_step"] for p in peers_view(board)["peers"]} == {1000.0, 3000.0}
    # A record whose counters went backwards (a restarted peer) gives no rate from it.
    restarted = dataclasses.replace(later.progress["a" * 52], step=25, sent_bytes=7)
    later.progress["a" * 52] = restarted
    board.update(later, 3.0)
    assert board.peers["a" * 52].bytes_per_step == 1000.0


def test_a_peers_bans_and_recoveries_are_events_once_and_fragments_in_flight_counted() -> None:
    board = Board("r")
    a, b = "a" * 52, "b" * 52
    ban = Notice(100.0, "peer_banned", "banned c for 60 s (false_data): <script>x</script>")
    found = reading({a: (1, 3.0, "averaged"), b: (1, 3.0, "averaged")})
    found.progress[a] = dataclasses.replace(found.progress[a], notices=(ban,), in_flight=2)
    found.progress[b] = dataclasses.replace(found.progress[b], in_flight=2)
    board.update(found, 1.0)
    rebuilt = Notice(101.0, "stage_recovered", "stage 1 rebuilt by CheckFree")
    other = Notice(102.0, "some_future_kind", "not shown")
    again = reading({a: (2, 3.0, "averaged"), b: (2, 3.0, "averaged")})
    again.progress[a] = dataclasses.replace(
        again.progress[a], notices=(ban, rebuilt, other), in_flight=0
    )
    board.update(again, 2.0)
    board.update(again, 3.0)
    notices = [(e["kind"], e["text"]) for e in board.events if e["kind"] in {"ban", "recovery"}]
    assert notices == [
        ("ban", "a" * 10 + ": banned c for 60 s (false_data): <script>x</script>"),
        ("recovery", "a" * 10 + ": stage 1 rebuilt by CheckFree"),
    ]
    assert run_view(board)["fragments_in_flight"] == {"0": 1}
    rows = {row["peer_id"][0]: row["in_flight"] for row in peers_view(board)["peers"]}
    assert rows == {"a": 0, "b": None}


def test_throwaway_identities_claiming_huge_rounds_do_not_take_over_the_page() -> None:
    """Issue 47: 60 identities publishing rounds up to 2^63 - 1 set the page's round, emptied
    the loss chart, made the honest peers' agreeing states show as differing and filled the
    event list. The board trusts the creator's round (the key that published the config)."""
    creator = Identity.generate().peer_id
    honest = [str(creator), "h" * 52, "i" * 52]
    strangers = [f"s{i:051d}" for i in range(60)]
    board = Board("r")
    for poll in range(20):
        found = reading({p: (5 + poll // 10, 3.0 - poll / 100, "averaged") for p in honest})
        for i, p in enumerate(strangers):
            found.heartbeats[p] = "127.0.0.1:9"
            huge = (1 << 63) - 1 - i - 60 * poll  # a fresh round every poll
            found.progress[p] = dataclasses.replace(
                RECORD, round=huge, val_loss=0.01, last_outer="alone"
            )
            found.adverts[p] = Advert(huge, f"forged{i}")
        found.run = parse_config(_value(b'{"algo": "diloco"}'), time.time())[0]
        assert found.run is not None
        found.run = dataclasses.replace(found.run, creator=str(creator))
        board.update(found, float(poll))
    assert run_view(board)["round"] == 6
    rows = {row["peer_id"]: row for row in peers_view(board)["peers"]}
    assert all(rows[p]["state_agrees"] for p in honest)
    assert not any(rows[p]["state_agrees"] for p in strangers)
    history = history_view(board)
    assert history["loss"]["rounds"] == [5, 6]
    assert {s["peer_id"] for s in history["loss"]["series"]} == set(honest)
    # The first poll: eight "is in the run" lines and one for the other 55.
    joins = [e for e in board.events if e["kind"] == "joined"]
    assert len(joins) == board_module.MAX_JOINS_PER_POLL + 1 == len(board.events) - 1
    assert joins[-1]["text"] == "55 more peers are in the run"
    # Without the creator's advert, the live peers' median round is trusted instead.
    del found.adverts[str(creator)]
    board.update(found, 21.0)
    assert run_view(board)["round"] > 1 << 62  # the strangers are a majority: a known limit
    found.heartbeats = {p: a for p, a in found.heartbeats.items() if p not in strangers[:59]}
    board.update(found, 22.0)
    assert run_view(board)["round"] == 6  # one stranger of three is not


def test_one_peer_holds_at_most_its_share_of_the_events() -> None:
    board = Board("r")
    loud = "l" * 52
    for poll in range(40):
        status = "alone" if poll % 2 else "local"
        board.update(reading({loud: (poll, 1.0, status), "q" * 52: (poll, 1.0, "averaged")}))
    assert sum(e["peer"] == loud for e in board.events) == board_module.MAX_EVENTS_PER_PEER
