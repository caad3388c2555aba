"""A sandbox target whose module cannot be imported: it needs a package nobody installed."""

import kz_no_such_dependency  # noqa: F401


def anything() -> int:
    return 1
