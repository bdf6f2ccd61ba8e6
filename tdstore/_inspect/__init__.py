"""Reading what stores a server holds, for ``tdstore ls``, ``info``, ``check`` and ``rm``."""
