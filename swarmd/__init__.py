"""swarmd: a fault-tolerant peer daemon for training one model together over the internet."""

__version__ = "0.1.1"
