"""A ring buffer cut into shards, each a one-node ring on its own primary of a Redis Cluster.

``ring`` (``ShardedRing``: creation, identity, reads, state; the protocol in its docstring) is made
of ``extend`` (writes), ``sample`` (samples, priorities), ``queue`` (rate limiter, queue, pop,
leases) over ``fan_out`` (calls on one shard or all at once); ``layout`` places the shards and
numbers the slots, ``info`` what ``tdstore ls``/``info`` show.
"""
