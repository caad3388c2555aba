"""``python -m kz_stream.cli``: the ``kz`` command line."""

from kz_stream.cli import main

main()
