"""Stores to disk and back (``tdstore export``/``import``), and stores written by ``tensordict.store``."""
