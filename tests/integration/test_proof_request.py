"""A member asking a reducer for its proof over real sockets: a lost connection is asked again
with the same nonce, a reducer's answer is final.

In CI a pair's states forked under 2 % injected loss: one member's proof request was lost,
it refused the reducer's part as unproven and kept its own values while the reducer took the
reduced part."""

from __future__ import annotations

import trio

from swarmd.node.averaging import verify
from swarmd.node.averaging.config import AllReduceConfig
from swarmd.node.averaging.group import Group, Member
from swarmd.node.averaging.round import Round
from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol import rpc
from swarmd.protocol.identity import Identity


class Reducer:
    """The reducer's GetProof face: fails the first ``fail_first`` calls with ``code`` (as a
    peer whose link drops or which answers), then serves a proof; keeps every nonce asked."""

    def __init__(self, fail_first: int, code: rpc.StatusCode) -> None:
        self.fail_first, self.code = fail_first, code
        self.nonces: list[bytes] = []

    async def get_proof(self, req: apb.ProofRequest, ctx: rpc.CallContext) -> apb.PartProof:
        self.nonces.append(bytes(req.nonce))
        if len(self.nonces) <= self.fail_first:
            raise rpc.RpcError(self.code, "refused by the test's reducer")
        return apb.PartProof(digest=bytes(req.nonce))

    def service(self) -> rpc.Service:
        return rpc.Service(
            "swarmd.averaging.v1.Averager",
            [rpc.unary("GetProof", apb.ProofRequest, self.get_proof)],
        )


def ask(reducer: Reducer, timeout: float) -> tuple[verify.Asked, float]:
    owner, me = Identity.generate(), Identity.generate()

    async def main() -> tuple[verify.Asked, float]:
        async with rpc.serve([reducer.service()], "127.0.0.1", 0, identity=owner) as server:
            group = Group(
                round_id=b"r" * 16,
                members=(
                    Member(me.peer_id, "127.0.0.1:9"),
                    Member(owner.peer_id, str(server.address)),
                ),
            )
            rnd = Round(group, 0, 8, AllReduceConfig(), "fp32")
            client = rpc.RpcClient(me)
            try:
                t0 = trio.current_time()
                asked = await verify.request_proof(rnd, client, 1, 0, timeout)
                return asked, trio.current_time() - t0
            finally:
                client.close()

    return trio.run(main)


def test_a_lost_request_is_asked_again_with_the_same_nonce() -> None:
    reducer = Reducer(fail_first=2, code=rpc.StatusCode.UNAVAILABLE)
    (proof, nonce), _ = ask(reducer, timeout=10.0)
    assert isinstance(proof, apb.PartProof) and proof.digest == nonce
    assert reducer.nonces == [nonce] * 3


def test_a_reducers_answer_is_not_asked_again() -> None:
    reducer = Reducer(fail_first=1, code=rpc.StatusCode.NOT_FOUND)
    (proof, _), _ = ask(reducer, timeout=10.0)
    assert isinstance(proof, str) and "was not given" in proof and "NOT_FOUND" in proof
    assert len(reducer.nonces) == 1


def test_a_reducer_that_stays_unreachable_costs_a_few_quick_tries_not_the_deadline() -> None:
    # A reducer killed mid-round: asking until the request's deadline held the round there.
    reducer = Reducer(fail_first=10**6, code=rpc.StatusCode.UNAVAILABLE)
    (proof, _), took = ask(reducer, timeout=30.0)
    assert isinstance(proof, str) and "UNAVAILABLE" in proof
    assert len(reducer.nonces) == verify.PROOF_TRIES
    assert took < 5.0
