"""A sandbox target whose module ends the process while it is imported, as an interpreter
that cannot start or a killed child would: no code under test has run."""

import os

os._exit(3)


def anything() -> int:
    return 1
