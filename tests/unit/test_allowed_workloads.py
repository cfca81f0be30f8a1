"""A run config's model and data names count only if this machine's user allowed them."""

from __future__ import annotations

import pytest

from swarmd.node.peer.options import JoinError
from swarmd.node.peer.runconfig import RunConfig, RunConfigError
from swarmd.node.peer.runrecord import Claim, choose
from swarmd.protocol.identity import Identity
from swarmd.workloads import AllowedWorkloads, WorkloadNotAllowed


def test_builtins_are_always_allowed() -> None:
    allowed = AllowedWorkloads()
    allowed.check_model("builtin")
    allowed.check_model("gpt")
    allowed.check_data("builtin")


@pytest.mark.parametrize("model", ["os:abort", "subprocess:run", "tests.harness.user_model:bigram"])
def test_code_named_by_a_run_is_refused_unless_given_locally(model: str) -> None:
    with pytest.raises(WorkloadNotAllowed, match=f"--model {model}"):
        AllowedWorkloads().check_model(model)
    AllowedWorkloads(models=(model,)).check_model(model)


def test_a_path_named_by_a_run_is_refused_unless_given_locally() -> None:
    with pytest.raises(WorkloadNotAllowed, match="--data /etc/passwd"):
        AllowedWorkloads().check_data("/etc/passwd")
    with pytest.raises(WorkloadNotAllowed):  # allowing one path allows no other
        AllowedWorkloads(data=("/data/a.txt",)).check_data("/data/b.txt")
    AllowedWorkloads(data=("/data/a.txt",)).check_data("/data/a.txt")


def test_the_creator_allows_its_own_run_file() -> None:
    own = AllowedWorkloads().with_own_run("mine:model", "/data/a.txt")
    own.check_model("mine:model")
    own.check_data("/data/a.txt")


@pytest.mark.parametrize("model", ["", "a b", "x" * 300, "os;abort"])
def test_a_malformed_model_name_is_a_config_error(model: str) -> None:
    with pytest.raises(RunConfigError, match="model must be"):
        RunConfig(name="t", model=model)


def test_the_creators_claim_is_chosen_and_ambiguity_refused() -> None:
    honest, impostor = Identity.generate().peer_id, Identity.generate().peer_id
    claims = [Claim(b"honest", honest), Claim(b"forged", impostor)]
    assert choose(claims, "t", honest) == claims[0]
    assert choose(claims[1:], "t", honest) is None  # the creator's not there (yet)
    assert choose(claims[:1], "t", None) == claims[0]
    assert choose([], "t", None) is None
    with pytest.raises(JoinError, match=r"2 different keys.*--creator"):
        choose(claims, "t", None)
