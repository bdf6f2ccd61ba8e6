"""The storage engine: one planned call sent as one round trip (a script or a checked transaction),
connections, deadlines, and stores spread over a cluster.  Imports nothing heavy here.
"""


def __getattr__(name: str) -> object:
    """Names of the module ``tdstore._engine`` this package replaced, for pickles made before (see ``tdstore._moved``)."""
    from tdstore._moved import shadowed_attribute

    return shadowed_attribute(__name__, name)
