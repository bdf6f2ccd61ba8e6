"""The shared ring buffer: ``extend``, ``sample``, ``pop``, priorities, rate limits, queues, leases and
waiting, one script call each.
"""
