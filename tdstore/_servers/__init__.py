"""Which ``redis-server`` binary embedded servers run, and the probes tests and tools share."""
