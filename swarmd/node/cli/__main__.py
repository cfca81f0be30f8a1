"""`python -m swarmd.node.cli`: what the child processes of demo, chaos and tests run."""

from swarmd.node.cli.app import entry

entry()
