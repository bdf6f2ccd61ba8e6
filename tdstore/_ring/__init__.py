"""The shared ring buffer: ``extend``, ``sample``, ``pop``, priorities, rate limits, queues, leases and
waiting, one script call each.
"""


def __getattr__(name: str) -> object:
    """Names of the module ``tdstore._ring`` this package replaced, for pickles made before (see ``tdstore._moved``)."""
    from tdstore._moved import shadowed_attribute

    return shadowed_attribute(__name__, name)
