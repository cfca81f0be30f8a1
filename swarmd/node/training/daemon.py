"""TEMPORARY shim while the CLI is split (removed before commit)."""

from swarmd.node.training.lifecycle import run_join
from swarmd.node.training.options import JoinOptions

__all__ = ["JoinOptions", "run_join"]
