"""The installed names: the services and migrations ship inside ``kz_stream``, not as
top-level packages called ``producers``, ``consumers`` or ``migrations`` that any other
distribution could shadow in site-packages."""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages

import kz_stream.consumers.learner
import kz_stream.migrations
import kz_stream.producers.coder

ROOT = Path(__file__).resolve().parents[2]


def test_only_kz_stream_is_installed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    found = set(find_packages(where=str(ROOT), include=include))
    assert {"kz_stream.producers", "kz_stream.consumers", "kz_stream.migrations"} <= found
    assert not {p.split(".")[0] for p in found} - {"kz_stream"}


def test_the_folders_stay_where_the_layout_puts_them() -> None:
    for module, folder in ((kz_stream.producers.coder, "producers"),
                           (kz_stream.consumers.learner, "consumers"),
                           (kz_stream.migrations, "migrations")):
        assert Path(module.__file__ or "").resolve().parent == ROOT / folder
        assert (ROOT / "kz_stream" / folder).is_symlink()


def test_alembic_files_ship_as_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = config["tool"]["setuptools"]["package-data"]["kz_stream.migrations"]
    assert {"*.ini", "*.mako", "versions/*.py"} <= set(data)
    assert (Path(kz_stream.migrations.__file__).parent / "alembic.ini").is_file()
