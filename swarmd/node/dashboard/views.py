"""The JSON API's bodies, built from the Board: /api/run, /api/peers, /api/events, /api/history,
/api/stages.

Plain dicts of str, int, finite float, bool and None (every number was validated finite when
read), so any JSON encoder that refuses NaN can send them. Field names are a contract with
the page (static/dashboard.js) and with scripts.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from swarmd.node.dashboard.board import Board, PeerView


def run_view(board: Board) -> dict[str, Any]:
    reading, now = board.reading, time.time()
    info = reading.run
    records = [v.record for v in board.peers.values() if v.live and v.record is not None]
    rounds = [r.round for r in records] + [a.round for a in reading.adverts.values()]
    flights = Counter(r.in_flight for r in records if r.in_flight is not None)
    return {
        "run": board.run,
        "found": info is not None,
        "error": reading.run_error or None,
        "config": None
        if info is None
        else {
            **info.fields,
            "hash": info.config_hash,
            "creator": info.creator,
            "age_s": info.age_s,
        },
        # The round the board trusts (board.anchor_round), not the largest anyone claims.
        "round": board.anchor_round() if reading.adverts else max(rounds, default=None),
        "step": max((r.step for r in records), default=None),
        "live_peers": sum(v.live for v in board.peers.values()),
        "gone_peers": sum(not v.live for v in board.peers.values()),
        "tokens_per_s": round(sum(r.tokens_per_s for r in records), 1),
        # Data-parallel's bytes a step over the swarm's, at the latest sample (None: none yet).
        "bytes_ratio": round(board.bytes[-1][2] / board.bytes[-1][1], 1)
        if board.bytes and board.bytes[-1][1] > 0
        else None,
        # Streaming DiLoCo: fragment -> live peers with its round on the wire now.
        "fragments_in_flight": {str(f): n for f, n in sorted(flights.items())},
        "refused_values": reading.refused,
        "polls": board.polls,
        "updated_s_ago": None if board.updated_at is None else round(now - board.updated_at, 1),
        "poll_error": board.poll_error or None,
    }


def _peer_row(view: PeerView, agreed: str | None, now: float) -> dict[str, Any]:
    record = view.record
    return {
        "peer_id": view.peer_id,
        "short_id": view.peer_id[:10],
        "name": record.name if record else "",
        "live": view.live,
        "address": view.address,
        "device": record.device if record else None,
        "tokens_per_s": record.tokens_per_s if record else None,
        "loss": record.loss if record else None,
        "val_loss": record.val_loss if record else None,
        "step": record.step if record else None,
        "round": record.round if record else view.advert_round,
        "group_size": record.group_size if record else None,
        "in_flight": record.in_flight if record else None,
        "last_outer": record.last_outer if record else None,
        "algo": record.algo if record else None,
        "sent_bytes": record.sent_bytes if record else None,
        "bytes_per_step": None if view.bytes_per_step is None else round(view.bytes_per_step, 1),
        "received_bytes": record.received_bytes if record else None,
        "state_hash": view.state_hash,
        # A gone peer's last advert is stale: not compared.
        "state_agrees": None
        if agreed is None or view.state_hash is None or not view.live
        else view.state_hash == agreed,
        "last_seen_s_ago": round(now - view.last_seen, 1),
    }


def peers_view(board: Board) -> dict[str, Any]:
    now, agreed = time.time(), board.agreed_hash()
    views = sorted(board.peers.values(), key=lambda v: (not v.live, v.peer_id))
    return {"agreed_state_hash": agreed, "peers": [_peer_row(v, agreed, now) for v in views]}


def events_view(board: Board) -> dict[str, Any]:
    return {"events": list(reversed(board.events))}


def history_view(board: Board) -> dict[str, Any]:
    """Chart data in uPlot's aligned form: one x array, one y array per series (None: gap)."""
    rounds = sorted(board.losses)
    peers = sorted({p for losses in board.losses.values() for p in losses})
    names = {p: Board.label(board.peers[p]) if p in board.peers else p[:10] for p in peers}
    group_rounds = sorted(board.groups)
    return {
        "loss": {
            "rounds": rounds,
            "series": [
                {
                    "peer_id": p,
                    "label": names[p],
                    "values": [board.losses[r].get(p) for r in rounds],
                }
                for p in peers
            ],
        },
        "tokens": {
            "times": [t for t, _ in board.tokens],
            "values": [v for _, v in board.tokens],
        },
        "groups": {"rounds": group_rounds, "sizes": [board.groups[r] for r in group_rounds]},
        "bytes": {
            "times": [t for t, _, _ in board.bytes],
            "swarm": [b for _, b, _ in board.bytes],
            "ddp": [d for _, _, d in board.bytes],
        },
    }


def stages_view(board: Board) -> dict[str, Any]:
    """A SWARM run's stages: each one's servers and total rate (micro-batches/s), and the
    bottleneck (the stage with the least: the pipeline runs at its speed)."""
    count = board.stage_count()
    servers: list[list[dict[str, Any]]] = [[] for _ in range(count)]
    for peer_id, r in sorted(board.reading.stages.items()):
        if r.stage >= count:
            continue
        view = board.peers.get(peer_id)
        servers[r.stage].append(
            {
                "peer_id": peer_id,
                "label": Board.label_of(peer_id, view.record if view else None),
                "address": r.address,
                "rate": round(r.rate, 3),
                "queue": r.queue,
                "state": r.state,
                "round": r.round,
            }
        )
    totals = [round(sum(s["rate"] for s in group), 3) for group in servers]
    bottleneck = min(range(count), key=lambda i: (totals[i], i)) if count else None
    return {
        "stages": [
            {
                "stage": i,
                "rate": totals[i],
                "servers": servers[i],
                "bottleneck": i == bottleneck,
            }
            for i in range(count)
        ],
        "bottleneck": bottleneck,
        "pipeline_rate": totals[bottleneck] if bottleneck is not None else None,
        # Rebuilt stages, as their rebuilders' notices said (newest first).
        "recoveries": [e for e in reversed(board.events) if e["kind"] == "recovery"],
    }
