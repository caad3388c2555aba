"""``kz infra``: local PostgreSQL and the Kafka-protocol broker."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from kz_stream.cli._output import _one_line_errors, console

infra_app = typer.Typer(help="Start and stop local PostgreSQL and the Kafka-protocol broker.")


def _infra_dir() -> Path:
    return Path(os.environ.get("KZ_INFRA_DIR", ".kz/infra")).resolve()


def _infra_state() -> dict[str, Any]:
    path = _infra_dir() / "state.json"
    return json.loads(path.read_text()) if path.exists() else {}


@infra_app.command("up")
@_one_line_errors
def infra_up() -> None:
    """Starts a private PostgreSQL cluster and the tansu broker; prints the env to use them."""
    from kz_stream.infra import LocalBroker, LocalPostgres

    root = _infra_dir()
    root.mkdir(parents=True, exist_ok=True)
    state = _infra_state()
    pg = LocalPostgres(root / "postgres", port=state.get("postgres_port", 0))
    if not (state and pg.running()):
        pg.start()
    broker = LocalBroker(port=state.get("broker_port", 0), pid=state.get("broker_pid", 0))
    if not broker.running():
        broker = LocalBroker().start(log_path=root / "broker.log")
    state = {
        "postgres_port": pg.port,
        "broker_port": broker.port,
        "broker_pid": broker.pid,
        "database_url": pg.url,
        "bus_url": f"kafka://{broker.bootstrap}",
    }
    (root / "state.json").write_text(json.dumps(state, indent=2))
    console.print(f"export KZ_DATABASE_URL={pg.url}", highlight=False)
    console.print(f"export KZ_BUS_URL=kafka://{broker.bootstrap}", highlight=False)


@infra_app.command("down")
@_one_line_errors
def infra_down() -> None:
    """Stops the local PostgreSQL cluster and broker started by ``kz infra up``."""
    from kz_stream.infra import LocalBroker, LocalPostgres

    root = _infra_dir()
    state = _infra_state()
    if not state:
        console.print("nothing is running")
        return
    LocalPostgres(root / "postgres", port=state["postgres_port"]).stop()
    LocalBroker(port=state["broker_port"], pid=state["broker_pid"]).stop()
    (root / "state.json").unlink()
    console.print("stopped postgres and broker")


@infra_app.command("status")
@_one_line_errors
def infra_status() -> None:
    """Shows whether the local services are up."""
    from kz_stream.infra import LocalBroker, LocalPostgres

    state = _infra_state()
    table = Table("service", "address", "up")
    if state:
        pg = LocalPostgres(_infra_dir() / "postgres", port=state["postgres_port"])
        broker = LocalBroker(port=state["broker_port"], pid=state["broker_pid"])
        table.add_row("postgres", state["database_url"], str(pg.running()))
        table.add_row("broker", state["bus_url"], str(broker.running()))
    console.print(table)
    if not state:
        raise typer.Exit(1)
