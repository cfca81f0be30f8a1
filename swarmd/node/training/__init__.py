"""Training: the peer lifecycle every algorithm shares, and one strategy per algorithm."""
