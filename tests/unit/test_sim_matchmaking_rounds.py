"""Matchmaking through real DHT nodes on the simulated network, then the real all-reduce,
in virtual time (tests/harness/matchmaking.py says why not loopback)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import trio

from swarmd.node.averaging.allreduce import AllReduceConfig, CodecName, Group, allreduce_named
from swarmd.node.averaging.matchmaking import MatchmakingConfig, form_group
from swarmd.node.runkeys import round_key
from swarmd.protocol import averaging_pb2 as apb
from tests.harness.matchmaking import (
    FAST,
    UNREACHABLE,
    Peer,
    form_all,
    matchmaking_peers,
    run_sim,
)


def test_peers_asking_at_once_agree_on_one_group_and_average() -> None:
    async def main() -> None:
        async with matchmaking_peers(4) as peers:
            with trio.fail_after(20):
                groups = await form_all(peers, round_key("run", 1), FAST)
            assert all(g is not None for g in groups)
            assert len({g.round_id for g in groups if g}) == 1
            group = groups[0]
            assert group is not None and len(group.members) == 4
            values = [torch.randn(1000) for _ in peers]
            results: list[torch.Tensor] = [torch.empty(0)] * 4

            async def reduce(i: int) -> None:
                res = await peers[i].averager.allreduce(group, values[i], 1.0)
                assert res.ok
                results[i] = res.tensor

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(reduce, i)
            truth = (sum(v.double() for v in values) / 4).float()
            assert all(torch.equal(r, truth) for r in results)
            text = peers[0].metrics.render().decode()
            assert 'swarmd_averaging_rounds_total{outcome="ok"} 1.0' in text
            # 3 parts of 250 fp32 values out, 3 in (plus headers), in each phase.
            sent = [ln for ln in text.splitlines() if ln.startswith("swarmd_averaging_bytes_total")]
            assert any('direction="sent"' in ln and float(ln.split()[1]) >= 6000 for ln in sent)
            assert any('direction="received"' in ln and float(ln.split()[1]) >= 6000 for ln in sent)

    run_sim(main)


def test_group_forms_with_whoever_is_there_after_the_deadline() -> None:
    async def main() -> None:
        async with matchmaking_peers(3) as peers:
            # Target 4, only 3 show up: after gather_s they go on with 3 (min is 2).
            start = trio.current_time()
            groups = await form_all(peers, round_key("run", 2), FAST)
            assert trio.current_time() - start >= FAST.gather_s - 0.5
            assert len({g.round_id for g in groups if g}) == 1
            assert all(g is not None and len(g.members) == 3 for g in groups)

    run_sim(main)


def test_a_lonely_peer_skips_the_round_and_a_latecomer_joins_the_next() -> None:
    async def main() -> None:
        async with matchmaking_peers(3) as peers:
            quick = MatchmakingConfig(
                target_group_size=3, min_group_size=2, gather_s=1.0, commit_wait_s=1.0
            )
            # Only peer 0 is ready for round 3: below min_group_size, it skips.
            assert (
                await form_group(peers[0].dht, round_key("run", 3), peers[0].member, quick) is None
            )
            # Round 4: everyone is there, including the peer that missed round 3.
            groups = await form_all(peers, round_key("run", 4), quick)
            assert len({g.round_id for g in groups if g}) == 1 and all(groups)

    run_sim(main)


def test_named_tensors_travel_with_a_codec_per_tensor() -> None:
    async def main() -> None:
        async with matchmaking_peers(3) as peers:
            groups = await form_all(peers, round_key("run", 5), FAST)
            group = groups[0]
            assert group is not None and all(g == group for g in groups)
            named = [{"bias": torch.randn(300), "weight": torch.randn(300, 300)} for _ in peers]
            outs: list[dict[str, torch.Tensor]] = [{}] * 3

            async def reduce(i: int) -> None:
                outs[i], results = await allreduce_named(peers[i].averager, group, named[i], 1.0)
                assert all(r.ok for r in results) and len(results) == 2

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(reduce, i)
            for name in ("bias", "weight"):
                assert all(torch.equal(o[name], outs[0][name]) for o in outs)
                assert outs[0][name].shape == named[0][name].shape
            bias_mean = (sum(n["bias"].double() for n in named) / 3).float()
            assert torch.equal(outs[0]["bias"], bias_mean)  # small: fp32, exact
            weight_mean = sum(n["weight"] for n in named) / 3
            err = float((outs[0]["weight"] - weight_mean).abs().max())
            assert 0 < err < 0.1  # large: int8, lossy but bounded
            text = peers[0].metrics.render().decode()
            assert 'codec="int8",direction="sent"' in text
            assert 'codec="fp32",direction="sent"' in text

    run_sim(main)


def _sent_part_bytes(peer: Peer) -> float:
    text = peer.metrics.render().decode()
    return sum(
        float(ln.rsplit(maxsplit=1)[1])
        for ln in text.splitlines()
        if ln.startswith("swarmd_averaging_bytes_total") and 'direction="sent"' in ln
    )


def test_zstd_framed_int8_parts_shrink_and_average_within_the_int8_bound() -> None:
    """Large int8 blocks plus a zstd frame (what DiLoCo runs use to get under 1 byte per
    value): the frame is lossless, so every peer still ends with the same bytes, within the
    int8 bound of the true mean, and sends fewer bytes than the same round unframed."""
    gen = torch.Generator().manual_seed(3)
    # Heavy-tailed, like a pseudo-gradient: most codes small, so they entropy-code well.
    values = [torch.distributions.StudentT(3.0).sample((40_000,)) for _ in range(3)]
    values = [(v * 1e-3 + torch.randn(40_000, generator=gen) * 1e-6) for v in values]
    sent: dict[int | None, float] = {}
    for level in (None, 3):
        config = AllReduceConfig(codec="int8", int8_block_size=4096, zstd_level=level)

        async def main(config: AllReduceConfig = config, level: int | None = level) -> None:
            async with matchmaking_peers(3, config) as peers:
                groups = await form_all(peers, round_key("run", 7), FAST)
                group = groups[0]
                assert group is not None and all(g == group for g in groups)
                results: list[torch.Tensor] = [torch.empty(0)] * 3

                async def reduce(i: int) -> None:
                    res = await peers[i].averager.allreduce(group, values[i], 1.0)
                    assert res.ok and not res.dropped
                    results[i] = res.tensor

                async with trio.open_nursery() as nursery:
                    for i in range(3):
                        nursery.start_soon(reduce, i)
                assert all(torch.equal(r, results[0]) for r in results)
                truth = sum(values) / 3
                # Each contribution is rounded once (<= absmax/254 of its block), the mean
                # once more; blocks are 4096 values, so bound by the largest absmax.
                bound = 2 * max(float(v.abs().max()) for v in values) / 254 + 1e-7
                assert float((results[0] - truth).abs().max()) <= bound
                sent[level] = sum(_sent_part_bytes(p) for p in peers)

        run_sim(main)
    # 2 phases x 3 peers x 2 parts of ~13,333 values at ~1 byte each, unframed.
    assert sent[None] >= 6 * 2 * 13_000
    assert sent[3] < 0.8 * sent[None]


async def _average_all(
    peers: list[Peer],
    key: str,
    values: list[torch.Tensor],
    codec: CodecName,
    outs: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """One all-reduce round of all `peers` (a group formed under `key`): their results."""
    groups = await form_all(peers, key, dataclasses.replace(FAST, target_group_size=len(peers)))
    group = groups[0]
    assert group is not None and all(g == group for g in groups)
    results: list[torch.Tensor] = [torch.empty(0)] * len(peers)

    async def reduce(i: int) -> None:
        out = None if outs is None else outs[i]
        res = await peers[i].averager.allreduce(
            group, values[i], 1.0, key=key, codec=codec, out=out
        )
        assert res.ok and not res.dropped
        assert out is None or res.tensor is out
        results[i] = res.tensor

    async with trio.open_nursery() as nursery:
        for i in range(len(peers)):
            nursery.start_soon(reduce, i)
    return results


def test_out_receives_the_same_average_and_bad_out_is_refused_before_the_round() -> None:
    """`out=` (a buffer a caller reuses every round) holds exactly the bytes a fresh result
    would, for int8 (whose reducer then quantises in place), fp16 and fp32; a buffer of the wrong
    size or dtype, or one overlapping the input, is refused before anything is sent."""
    values = [torch.randn(30_001, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    for v in values:
        v[::5] = -1e-9  # averages that round to int8 code 0: +0.0 everywhere, not -0.0 at one

    async def main() -> None:
        async with matchmaking_peers(3, AllReduceConfig(codec="int8")) as peers:
            for r, codec in enumerate(("int8", "fp16", "fp32")):
                # Separate keys: no error-feedback residual carries from one round to the other.
                fresh = await _average_all(peers, round_key("run", 10 + 2 * r), values, codec)
                reused = [torch.full((30_001,), math.nan) for _ in range(3)]
                await _average_all(peers, round_key("run", 11 + 2 * r), values, codec, reused)
                # The same bytes (torch.equal would let -0.0 pass for 0.0).
                first = fresh[0].view(torch.int32)
                for i in range(3):
                    assert torch.equal(fresh[i].view(torch.int32), first)
                    assert torch.equal(reused[i].view(torch.int32), first)
            group = Group(b"x" * 32, [p.member for p in peers])
            for bad in (torch.empty(30_000), values[0], torch.empty(30_001, dtype=torch.float64)):
                with pytest.raises(ValueError, match="out must"):
                    await peers[0].averager.allreduce(group, values[0], 1.0, out=bad)

    run_sim(main)


def test_a_latecomer_does_not_group_with_peers_already_committed() -> None:
    async def main() -> None:
        async with matchmaking_peers(4) as peers:
            key = round_key("run", 6)
            early = await form_all(peers[:3], key, FAST)
            assert all(g is not None and len(g.members) == 3 for g in early)
            # Their announcements are still in the DHT, but they have averaged and moved on.
            quick = MatchmakingConfig(
                target_group_size=4, min_group_size=2, gather_s=1.0, commit_wait_s=1.0
            )
            late = await form_group(peers[3].dht, key, peers[3].member, quick)
            assert late is None

    run_sim(main)


def test_a_peer_that_announced_and_died_does_not_block_the_round() -> None:
    """The lowest id leads. If that peer died after announcing (its address no longer answers),
    the others must leave it out and form their group, not wait for its record and skip."""

    async def main() -> None:
        async with matchmaking_peers(4) as peers:
            key = round_key("run", 9)
            ghost, *live = sorted(peers, key=lambda p: p.identity.peer_id)
            dead = apb.MemberInfo(address=UNREACHABLE, bandwidth=1e8).SerializeToString()
            await ghost.dht.store(key, dead, ghost.dht.now() + 60, subkey=str(ghost.member.peer_id))  # type: ignore[attr-defined]
            groups = await form_all(live, key, FAST)
            assert all(g is not None for g in groups), groups
            members = {tuple(m.peer_id for m in g.members) for g in groups if g is not None}
            assert members == {tuple(p.identity.peer_id for p in live)}

    run_sim(main)


def test_a_peer_still_gathering_goes_at_once_when_a_leader_commits_to_it() -> None:
    """Peers can wait for different group sizes (each counts the run's live peers itself; at a
    run's start some count fewer). A leader content with two commits as soon as it sees a
    follower that waits for three; the follower must join then, not when its gather deadline
    passes, by which time the leader has dropped it from the all-reduce."""

    async def main() -> None:
        async with matchmaking_peers(3) as peers:
            key = round_key("run", 11)
            leader, follower = sorted(peers, key=lambda p: p.identity.peer_id)[:2]
            content = MatchmakingConfig(
                target_group_size=2, min_group_size=2, gather_s=8.0, commit_wait_s=8.0
            )
            patient = MatchmakingConfig(
                target_group_size=3, min_group_size=2, gather_s=8.0, commit_wait_s=8.0
            )
            groups: dict[str, Group | None] = {}
            took: dict[str, float] = {}

            async def form(name: str, peer: Peer, cfg: MatchmakingConfig) -> None:
                start = trio.current_time()
                groups[name] = await form_group(peer.dht, key, peer.member, cfg)
                took[name] = trio.current_time() - start

            async with trio.open_nursery() as nursery:
                nursery.start_soon(form, "leader", leader, content)
                nursery.start_soon(form, "follower", follower, patient)
            a, b = groups["leader"], groups["follower"]
            assert a is not None and b is not None
            assert a.round_id == b.round_id and len(b.members) == 2
            # Polls back off to at most max_poll_s (1 s): the follower sees the commitment
            # within a few polls of it, far inside its 8 s gather deadline.
            assert took["follower"] < 4.0, took

    run_sim(main)


def test_news_stored_on_a_waiting_peers_own_node_ends_its_wait_before_the_next_poll() -> None:
    """In a network smaller than k every node holds every record, so the last announcement
    and the leader's group record land on the waiting peers' own nodes: they must act on them
    then, not at their next poll (a poll later was about a second of every streaming round)."""

    async def main() -> None:
        async with matchmaking_peers(4) as peers:
            key = round_key("run", 12)
            slow_polls = MatchmakingConfig(
                target_group_size=4, min_group_size=2, gather_s=10.0, commit_wait_s=10.0,
                poll_s=4.0, poll_growth=1.0, max_poll_s=4.0,
            )  # fmt: skip
            groups: list[Group | None] = [None] * 4
            done: list[float] = [0.0] * 4

            async def form(i: int, delay: float) -> None:
                await trio.sleep(delay)
                groups[i] = await form_group(peers[i].dht, key, peers[i].member, slow_polls)
                done[i] = trio.current_time()

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(form, i, 0.0)
                nursery.start_soon(form, 3, 0.5)
                last_arrival = trio.current_time() + 0.5
            assert all(g is not None and len(g.members) == 4 for g in groups), groups
            assert len({g.round_id for g in groups if g is not None}) == 1
            # By polls alone the leader would see the last peer at 4 s and its followers the
            # group at their next poll after that: about 4-8 s after the last arrival.
            assert max(done) - last_arrival < 2.0, [t - last_arrival for t in done]

    run_sim(main)
