"""``python -m tdstore ...``: the same as the ``tdstore`` console script.

The ``__name__`` guard matters: the demo spawns actor processes, and a spawned
child re-imports the parent's main module; without the guard each child would
run the CLI again.
"""

import sys

from tdstore.cli import main

if __name__ == "__main__":
    sys.exit(main())
