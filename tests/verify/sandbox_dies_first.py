"""A sandbox target whose module ends the process the first time it is imported, as a
child that could not start once would (seen in CI: its numpy failed to import while the
host was short of memory), and loads on the next attempt."""

import os

if os.environ.get("KZ_SANDBOX_ATTEMPT") == "1":
    os._exit(3)


def value() -> int:
    return 7
