"""Optimisers (DiLoCo, streaming DiLoCo, DeMo): pure torch, no I/O; they take an averaging function."""
