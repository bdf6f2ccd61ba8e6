"""A ring buffer cut into shards, each a one-node ring on its own primary of a Redis Cluster."""
