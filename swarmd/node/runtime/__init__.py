"""Process plumbing every command shares: error unwrapping, heap settings, child processes."""
