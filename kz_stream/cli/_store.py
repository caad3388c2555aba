"""``kz db``, ``replay``, ``audit``, ``tail``, ``frontier``: the event store and its read models."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kz_stream.cli._common import ConfigOption, _read_store, _run, _settings
from kz_stream.cli._output import _one_line_errors, console, err_console
from kz_stream.database_url import ensure_sqlite_dir, redact

db_app = typer.Typer(help="Event store schema.")


@db_app.command("upgrade")
@_one_line_errors
def db_upgrade(config: ConfigOption = None, revision: str = "head") -> None:
    """Migrates the event store schema (Alembic) to ``revision``."""
    from kz_stream.store import upgrade

    settings = _settings(config)
    ensure_sqlite_dir(settings.database_url)
    upgrade(settings.database_url, revision)
    console.print(f"database at {revision}: {redact(settings.database_url)}", highlight=False)


@_one_line_errors
def replay(
    projection: Annotated[str, typer.Option(help="Projection to rebuild.")] = "kernels",
    config: ConfigOption = None,
) -> None:
    """Rebuilds a projection from position 0 and reports events/s."""
    from kz_stream.app import projection_by_name
    from kz_stream.projections import rebuild
    from kz_stream.store import open_store

    settings = _settings(config)

    async def go() -> Any:
        async with open_store(settings.database_url) as store:
            total = await store.last_position()
            with Progress(
                TextColumn("replay {task.fields[name]}"),
                BarColumn(),
                TextColumn("{task.completed:,}/{task.total:,} positions"),
                TimeElapsedColumn(),
                console=err_console,
            ) as progress:
                task = progress.add_task("replay", total=total, name=projection)
                return await rebuild(
                    store,
                    projection_by_name(projection),
                    on_batch=lambda pos: progress.update(task, completed=pos),
                )

    stats = _run(go())
    console.print(
        f"rebuilt {projection}: {stats.events:,} events in {stats.seconds:.2f}s "
        f"({stats.events_per_s:,.0f} events/s)"
    )


@_one_line_errors
def audit(
    stream_id: Annotated[str, typer.Argument(help="Stream id, e.g. kernel-<id>.")],
    config: ConfigOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per event.")] = False,
) -> None:
    """Prints a stream's full history, oldest first."""
    from kz_stream.events import encode_event

    settings = _settings(config)
    records = _read_store(settings, lambda store: store.read_stream(stream_id))
    if not records:
        raise LookupError(f"no stream {stream_id!r} in {redact(settings.database_url)}")
    if as_json:
        for r in records:
            sys.stdout.write(encode_event(r.event).decode() + "\n")
        return
    for r in records:
        e = r.event
        console.rule(
            f"#{r.global_position}  v{e.stream_version}  {e.type} (schema v{e.schema_version})"
        )
        console.print(
            f"event_id={e.event_id} occurred_at={e.occurred_at.isoformat()} "
            f"producer={e.producer} correlation={e.correlation_id} causation={e.causation_id}",
            highlight=False,
        )
        console.print_json(data=e.payload)


@_one_line_errors
def tail(
    config: ConfigOption = None,
    from_position: Annotated[int, typer.Option("--from", help="Start after this position.")] = -1,
    limit: Annotated[int, typer.Option(help="Stop after this many events (0: follow).")] = 0,
) -> None:
    """Follows the store, printing one line per event as it commits."""
    from kz_stream.store import open_store

    settings = _settings(config)

    async def go() -> None:
        async with open_store(settings.database_url, create_schema=False) as store:
            start = from_position if from_position >= 0 else await store.last_position()
            seen = 0
            async for batch in store.tail(start):
                for r in batch:
                    e = r.event
                    console.print(
                        f"{r.global_position:>10}  {e.type:<24} {e.stream_id}  v{e.stream_version}",
                        highlight=False,
                    )
                    seen += 1
                    if limit and seen >= limit:
                        return

    try:
        _run(go())
    except KeyboardInterrupt:
        pass


@_one_line_errors
def frontier(
    config: ConfigOption = None,
    heatmap: Annotated[
        Path | None, typer.Option(help="Write the API-pair pass-rate heatmap to this PNG.")
    ] = None,
    top: Annotated[int, typer.Option(help="Rows to show.")] = 30,
) -> None:
    """Shows the capability map (pass rate and speed per API) and the current frontier."""
    from kz_stream.run_state import CapabilityMap, RunState, compute_frontier
    from kz_stream.store import open_store

    settings = _settings(config)

    async def go() -> RunState:
        state = RunState()
        async with open_store(settings.database_url, create_schema=False) as store:
            async for batch in store.read_all(0):
                state.apply_all(batch)
        return state

    state = _run(go())
    cmap = CapabilityMap.from_state(state)
    front = compute_frontier(state)
    table = Table(
        "api",
        "kernels",
        "pass rate",
        "median speedup",
        "slow share",
        "trend",
        title=f"capability map at position {state.position:,}",
    )
    for api, st in sorted(cmap.apis.items(), key=lambda kv: kv[1].pass_rate)[:top]:
        med = st.median_speedup
        table.add_row(
            api,
            str(st.n),
            f"{st.pass_rate:.2f}",
            f"{med:.2f}" if med else "-",
            f"{st.slow_fraction:.2f}",
            f"{st.trend:+.2f}",
        )
    console.print(table)
    console.print(f"weak APIs: {', '.join(list(front.weak_apis)[:10]) or '-'}", highlight=False)
    console.print(f"slow APIs: {', '.join(list(front.slow_apis)[:10]) or '-'}", highlight=False)
    if heatmap is not None:
        _write_heatmap(cmap, heatmap)
        console.print(f"heatmap written to {heatmap}")


def _write_heatmap(cmap: Any, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    apis = sorted(cmap.apis)
    index = {a: i for i, a in enumerate(apis)}
    grid = np.full((len(apis), len(apis)), np.nan)
    for i, a in enumerate(apis):
        grid[i, i] = cmap.apis[a].pass_rate
    for pair, st in cmap.pairs.items():
        a, b = pair.split("+", 1)
        grid[index[a], index[b]] = grid[index[b], index[a]] = st.pass_rate
    size = max(4.0, 0.35 * len(apis) + 2)
    fig, ax = plt.subplots(figsize=(size, size))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn")
    ax.set_xticks(range(len(apis)), apis, rotation=90, fontsize=7)
    ax.set_yticks(range(len(apis)), apis, fontsize=7)
    ax.set_title("Coder pass rate per API (diagonal) and API pair")
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
