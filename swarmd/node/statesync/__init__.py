"""State sync: a joiner (or a peer that fell behind) downloads the group's state from donors.

snapshot: the content-addressed, chunked form of a state; donor: serving it and advertising it
in the DHT; download: fetching it from several donors at once; catchup: which advertised state
a peer takes instead of its own.
"""
