"""Measuring and checking tools of the source tree, run from the repository root as ``python -m tools.<name>``.

Not part of the installed package; ``tools/README.md`` says what each one measures and holds its figures.
"""
