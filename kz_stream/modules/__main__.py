"""``python -m kz_stream.modules build``: mines the API catalog (see ``_catalog``)."""

from __future__ import annotations

import sys

from kz_stream.modules._catalog import main

sys.exit(main())
