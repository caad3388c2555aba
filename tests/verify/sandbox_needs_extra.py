"""A sandbox target that needs ``kz_extra_dependency``, which a test puts on the search path
outside the Python installation (as a PYTHONPATH folder would be)."""

import kz_extra_dependency


def value() -> int:
    return int(kz_extra_dependency.VALUE)
