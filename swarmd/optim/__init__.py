"""Optimisers (DiLoCo, streaming DiLoCo, DeMo): pure torch, no I/O.

They take an averaging function and never touch the network.
"""
