"""Stores to disk and back (``tdstore export``/``import``), and stores written by ``tensordict.store``."""


def __getattr__(name: str) -> object:
    """Names of the module ``tdstore._checkpoint`` this package replaced, for pickles made before (see ``tdstore._moved``)."""
    from tdstore._moved import shadowed_attribute

    return shadowed_attribute(__name__, name)
