"""Alembic's own command line finds the event store as the services do: through
``load_settings`` (``KZ_*`` variables over the TOML file of ``-x config=`` or
``KZ_CONFIG_FILE``), not through a variable of its own. A store written at an earlier
revision keeps its events through an upgrade, and each revision's downgrade undoes it."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, inspect, text

import kz_stream.migrations
from kz_stream.database_url import sync_url
from kz_stream.events import Event, KernelVerified, VerdictStatus, new_event
from kz_stream.store import SqlEventStore, upgrade

INI = Path(kz_stream.migrations.__file__).with_name("alembic.ini")
CORRELATION_INDEX = "ix_events_correlation"


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


# -- revisions ------------------------------------------------------------------------------


def downgrade(url: str, revision: str) -> None:
    cfg = Config(str(INI))
    cfg.set_main_option("sqlalchemy.url", sync_url(url).replace("%", "%%"))
    command.downgrade(cfg, revision)


def event_indexes(url: str) -> dict[str, list[str | None]]:
    """The events table's indexes by name, with their columns."""
    engine = create_engine(sync_url(url))
    try:
        with engine.connect() as conn:
            return {str(i["name"]): list(i["column_names"])
                    for i in inspect(conn).get_indexes("events")}
    finally:
        engine.dispose()


def revision(url: str) -> str:
    engine = create_engine(sync_url(url))
    try:
        with engine.connect() as conn:
            return str(conn.scalar(text("SELECT version_num FROM alembic_version")))
    finally:
        engine.dispose()


def verdicts_of_two_runs() -> list[Event]:
    return [
        new_event(KernelVerified(kernel_id=f"k{i}", module_id="m", group_id="g",
                                 status=VerdictStatus.CORRECT),
                  stream_id=f"kernel-k{i}", stream_version=1,
                  correlation_id="run-a" if i % 2 else "run-b")
        for i in range(6)
    ]


async def test_upgrading_a_0001_store_indexes_its_events_by_correlation_id(
    store_url: str,
) -> None:
    upgrade(store_url, "0001")
    events = verdicts_of_two_runs()
    async with SqlEventStore(store_url) as store:  # written before the index existed
        await store.append(events)
    assert CORRELATION_INDEX not in event_indexes(store_url)

    upgrade(store_url)

    assert event_indexes(store_url)[CORRELATION_INDEX] == ["correlation_id", "global_position"]
    async with SqlEventStore(store_url) as store:
        run_a = [r.event async for b in store.read_all(correlation_id="run-a") for r in b]
    assert run_a == [e for e in events if e.correlation_id == "run-a"]


def test_downgrading_to_0001_drops_the_correlation_index(store_url: str) -> None:
    upgrade(store_url)

    downgrade(store_url, "0001")

    assert CORRELATION_INDEX not in event_indexes(store_url)
    assert revision(store_url) == "0001"


def _upgrade_when_all_are_ready(url: str, ready: Any) -> str:
    ready.wait()
    try:
        upgrade(url)
    except Exception as e:  # the test shows every process's outcome
        return f"{type(e).__name__}: {e}"[:300]
    return "ok"


def test_processes_migrating_a_fresh_store_at_once_all_succeed(store_url: str) -> None:
    """Services (and `kz db upgrade`) starting together on a new database: each waits for
    the one migrating, then finds the schema at head (the losers died on a unique
    violation, or on "table already exists")."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(4, mp_context=ctx) as pool:
        ready = manager.Barrier(4)
        outcomes = list(pool.map(_upgrade_when_all_are_ready, [store_url] * 4, [ready] * 4))
    assert outcomes == ["ok"] * 4
    engine = create_engine(sync_url(store_url))
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1
    finally:
        engine.dispose()
