"""Alembic's own command line finds the event store as the services do: through
``load_settings`` (``KZ_*`` variables over the TOML file of ``-x config=`` or
``KZ_CONFIG_FILE``), not through a variable of its own."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import kz_stream.migrations

INI = Path(kz_stream.migrations.__file__).with_name("alembic.ini")


def alembic(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("KZ_")}
    return subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(INI), *args],
        capture_output=True, text=True, timeout=120, cwd=cwd, env={**clean, **env},
    )


def tables(db: Path) -> set[str]:
    with sqlite3.connect(db) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def test_the_toml_file_of_x_config_names_the_database(tmp_path: Path) -> None:
    db = tmp_path / "store" / "kz.sqlite3"  # its folder is created, as the services do
    config = tmp_path / "kz.toml"
    config.write_text(f'database_url = "sqlite+aiosqlite:///{db}"\n')
    out = alembic("-x", f"config={config}", "upgrade", "head", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert {"events", "tracking", "alembic_version"} <= tables(db)


def test_the_environment_wins_over_kz_config_file(tmp_path: Path) -> None:
    in_file, in_env = tmp_path / "file.sqlite3", tmp_path / "env.sqlite3"
    config = tmp_path / "kz.toml"
    config.write_text(f'database_url = "sqlite+aiosqlite:///{in_file}"\n')
    out = alembic("upgrade", "head", cwd=tmp_path, KZ_CONFIG_FILE=str(config),
                  KZ_DATABASE_URL=f"sqlite:///{in_env}")
    assert out.returncode == 0, out.stderr
    assert "events" in tables(in_env) and not in_file.exists()


def test_a_bad_setting_is_named_as_the_services_name_it(tmp_path: Path) -> None:
    config = tmp_path / "kz.toml"
    config.write_text('databse_url = "sqlite:///x.sqlite3"\n')
    out = alembic("-x", f"config={config}", "upgrade", "head", cwd=tmp_path)
    assert out.returncode != 0
    assert f"databse_url = 'sqlite:///x.sqlite3' (in {config}): unknown key" in out.stderr
