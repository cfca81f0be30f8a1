"""All of a volunteer's GPUs (or CPU sockets) behind one peer: `swarmd join --local-workers N`."""
