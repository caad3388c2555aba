"""The ``kz`` command line. Errors print one clear line and exit non-zero."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from datetime import UTC, datetime
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ParamSpec, TypeGuard, TypeVar, get_args

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kz_stream.config import (
    ConfigError,
    Settings,
    describe_validation_error,
    load_settings,
    validated_copy,
)
from kz_stream.database_url import ensure_sqlite_dir, redact
from kz_stream.verify import Backend

if TYPE_CHECKING:
    from kz_stream.app import RunOptions
    from kz_stream.export import KernelFilter
    from kz_stream.store import EventStore
    from kz_stream.summary import Outcome, RunSummary

app = typer.Typer(
    name="kz",
    help="kz_stream: train LLMs to write fast, correct GPU kernels.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
infra_app = typer.Typer(help="Start and stop local PostgreSQL and the Kafka-protocol broker.")
db_app = typer.Typer(help="Event store schema.")
app.add_typer(infra_app, name="infra")
app.add_typer(db_app, name="db")
dlq_app = typer.Typer(help="Inspect and re-drive dead letters.")
app.add_typer(dlq_app, name="dlq")
eval_app = typer.Typer(help="Evaluate a Coder policy on a KernelBench-format suite.")
app.add_typer(eval_app, name="eval")
dataset_app = typer.Typer(help="Hugging Face datasets replayed from the event store.")
app.add_typer(dataset_app, name="dataset")
warmstart_app = typer.Typer(help="Teacher-distilled SFT data and adapters for a warm start.")
app.add_typer(warmstart_app, name="warmstart")

console = Console()
err_console = Console(stderr=True)

P = ParamSpec("P")
R = TypeVar("R")

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="TOML config file (env vars override it).")
]
# Which stored kernels a command reads (kz dataset export, kz rescore).
RunsOption = Annotated[
    list[str] | None, typer.Option("--run", help="Only kernels of these runs (correlation ids).")
]
SinceOption = Annotated[
    datetime | None, typer.Option(help="Kernels generated at or after this time (UTC).")
]
UntilOption = Annotated[
    datetime | None, typer.Option(help="Kernels generated before this time (UTC).")
]
IncludeEvalOption = Annotated[
    bool, typer.Option(help="Also evaluation runs (left out unless --run names them).")
]


def _one_line_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turns any exception into one red line on stderr and exit code 1."""

    @wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except Exception as e:  # the CLI's edge: report, never dump a traceback
            if os.environ.get("KZ_DEBUG"):
                raise
            if isinstance(e, ConfigError):
                # Already names the key, value, expectation and source (two lines at most).
                lines = str(e).splitlines()[:2]
                err_console.print(f"[red]error:[/red] config: {lines[0]}", highlight=False)
                for line in lines[1:]:
                    err_console.print(f"       {line}", highlight=False)
                raise typer.Exit(1) from None
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            err_console.print(f"[red]error:[/red] {type(e).__name__}: {msg}", highlight=False)
            raise typer.Exit(1) from None

    return wrapper


# Settings fields whose command-line option has another name.
_OPTION_OF_FIELD = {"roles": "--role", "proposer_steps": "--steps-per-turn",
                    "coder_steps": "--steps-per-turn", "max_tokens": "--max-new-tokens"}


def _option(loc: tuple[int | str, ...]) -> str:
    field = str(loc[0]) if loc else "?"
    return _OPTION_OF_FIELD.get(field, "--" + field.replace("_", "-"))


def _bad_option(e: ValidationError) -> ConfigError:
    """The first invalid setting, named as its command-line option."""
    return ConfigError(
        describe_validation_error(e, lambda _loc: "command line", key=_option)
    )


def _settings(config: Path | None, *, quiet: bool = False) -> Settings:
    """The settings (``--config`` over the defaults, under the environment). ``quiet``: a
    command that draws progress bars logs warnings only, unless the user set log_level."""
    settings = load_settings(config)
    if quiet and "log_level" not in settings.model_fields_set:
        settings = settings.model_copy(update={"log_level": "WARNING"})
    return settings


def _run(coro: Coroutine[Any, Any, R]) -> R:
    return asyncio.run(coro)


def _read_store(settings: Settings, read: Callable[[EventStore], Coroutine[Any, Any, R]]) -> R:
    """``read``'s result on the event store, opened as it is (a command that only reads
    migrates nothing)."""
    from kz_stream.store import open_store

    async def go() -> R:
        async with open_store(settings.database_url, create_schema=False) as store:
            return await read(store)

    return _run(go())


def _is_backend(name: str) -> TypeGuard[Backend]:
    return name in get_args(Backend)


# ---------------------------------------------------------------------------------- infra


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


# ------------------------------------------------------------------------------------ db


@db_app.command("upgrade")
@_one_line_errors
def db_upgrade(config: ConfigOption = None, revision: str = "head") -> None:
    """Migrates the event store schema (Alembic) to ``revision``."""
    from kz_stream.store import upgrade

    settings = _settings(config)
    ensure_sqlite_dir(settings.database_url)
    upgrade(settings.database_url, revision)
    console.print(f"database at {revision}: {redact(settings.database_url)}", highlight=False)


# ----------------------------------------------------------------------------------- dlq

OriginOption = Annotated[
    str | None, typer.Option("--origin", help="Only letters from this topic.")
]
GroupOption = Annotated[
    str | None, typer.Option("--group", help="Only letters dead-lettered by this group.")
]


async def _dead_letters(settings: Settings, origin: str | None, group: str | None,
                        offsets: list[int] | None = None) -> tuple[Any, list[Any]]:
    """The started bus and the dead letters that pass the filters."""
    from kz_stream.bus import open_bus
    from kz_stream.dlq import list_dead_letters

    if settings.embedded:
        raise ValueError("the embedded bus (memory://) lives inside one process; set "
                         "KZ_BUS_URL to the broker (kz infra up prints it)")
    bus = open_bus(settings.bus_url, client_id="kz-dlq")
    await bus.start()
    try:
        letters = await list_dead_letters(bus, settings.topics.dead_letter)
    except BaseException:
        await bus.close()
        raise
    return bus, [
        d for d in letters
        if (origin is None or d.origin_topic == origin)
        and (group is None or d.group == group)
        and (not offsets or d.message.offset in offsets)
    ]


@dlq_app.command("list")
@_one_line_errors
def dlq_list(
    config: ConfigOption = None,
    origin: OriginOption = None,
    group: GroupOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per letter.")] = False,
) -> None:
    """Lists the dead letters: where each came from, which group gave up on it, and why."""
    settings = _settings(config)

    async def go() -> list[Any]:
        bus, letters = await _dead_letters(settings, origin, group)
        await bus.close()
        return letters

    letters = _run(go())
    if as_json:
        for d in letters:
            sys.stdout.write(json.dumps(d.as_dict()) + "\n")
        return
    table = Table("offset", "origin", "group", "type", "error",
                  title=f"{len(letters)} dead letter(s) in {settings.topics.dead_letter}")
    for d in letters:
        table.add_row(d.where, d.origin, d.group, d.event_type, d.error.splitlines()[0][:120])
    console.print(table)


@dlq_app.command("redrive")
@_one_line_errors
def dlq_redrive(
    config: ConfigOption = None,
    offset: Annotated[
        list[int] | None, typer.Option(help="Only the letter at this dead-letter offset.")
    ] = None,
    origin: OriginOption = None,
    group: GroupOption = None,
    all_letters: Annotated[
        bool, typer.Option("--all", help="Every letter (when no filter is given).")
    ] = False,
    dry_run: Annotated[bool, typer.Option(help="Show what would be re-driven.")] = False,
) -> None:
    """Publishes dead letters back to their origin topics, as they were."""
    from kz_stream.dlq import redrive

    if not (offset or origin or group or all_letters):
        raise typer.BadParameter("choose letters with --offset, --origin or --group, or --all")
    settings = _settings(config)

    async def go() -> tuple[list[Any], list[Any]]:
        bus, letters = await _dead_letters(settings, origin, group, offset)
        try:
            if dry_run:
                return letters, []
            report = await redrive(bus, settings.topics.dead_letter, letters)
            return report.redriven, report.skipped
        finally:
            await bus.close()

    done, skipped = _run(go())
    verb = "would re-drive" if dry_run else "re-drove"
    for d in done:
        console.print(f"{verb} {d.where} -> {d.origin_topic}", highlight=False)
    for d, why in skipped:
        console.print(f"skipped {d.where}: {why}", highlight=False)
    console.print(f"{verb} {len(done)} dead letter(s), skipped {len(skipped)}", highlight=False)


# -------------------------------------------------------------------------------- serve

SERVICES = ("recorder", "verifier", "proposer", "coder", "learner")


@app.command()
@_one_line_errors
def serve(
    service: Annotated[str, typer.Argument(help=f"One of: {', '.join(SERVICES)}.")],
    config: ConfigOption = None,
) -> None:
    """Runs one long-lived service until SIGTERM/SIGINT."""
    from kz_stream.app import run_named_services

    if service not in SERVICES:
        raise typer.BadParameter(f"unknown service {service!r}; choose from {', '.join(SERVICES)}")
    _run(run_named_services(_settings(config), [service]))


# ------------------------------------------------------------------------ replay/audit/tail


@app.command()
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


@app.command()
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


@app.command()
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


@app.command()
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


@app.command()
@_one_line_errors
def train(
    config: ConfigOption = None,
    role: Annotated[
        list[str] | None, typer.Option(help="Role(s) to train: coder, proposer (default both).")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="Base model directory (default SmolLM2).")
    ] = None,
    checkpoint_dir: Annotated[Path | None, typer.Option(help="Where policies are written.")] = None,
    groups_per_step: Annotated[int | None, typer.Option(help="Complete groups per step.")] = None,
    steps_per_turn: Annotated[int | None, typer.Option(help="Steps per role per round.")] = None,
    rounds: Annotated[int | None, typer.Option(help="Alternation rounds.")] = None,
    learning_rate: Annotated[float | None, typer.Option(help="Optimizer learning rate.")] = None,
    lora_r: Annotated[int | None, typer.Option(help="LoRA rank.")] = None,
    full_finetune: Annotated[
        bool | None, typer.Option("--full-finetune/--lora", help="Full fine-tuning or LoRA.")
    ] = None,
    max_staleness: Annotated[
        int | None, typer.Option(help="Drop samples more than this many versions old.")
    ] = None,
) -> None:
    """Runs the learner (CA-GRPO for the Coder, GRPO for the Proposer) against the store,
    with learner settings overridden from the command line."""
    from kz_stream.app import run_named_services

    settings = _settings(config)
    overrides: dict[str, Any] = {
        "roles": tuple(role) if role else None,
        "model": model,
        "checkpoint_dir": checkpoint_dir,
        "groups_per_step": groups_per_step,
        "proposer_steps": steps_per_turn,
        "coder_steps": steps_per_turn,
        "rounds": rounds,
        "learning_rate": learning_rate,
        "lora_r": lora_r,
        "full_finetune": full_finetune,
        "max_staleness": max_staleness,
    }
    for r in role or []:
        if r not in ("coder", "proposer"):
            raise typer.BadParameter(f"unknown role {r!r}; choose coder or proposer")
    try:
        learner = validated_copy(
            settings.learner, **{k: v for k, v in overrides.items() if v is not None}
        )
    except ValidationError as e:
        raise _bad_option(e) from None
    settings = settings.model_copy(update={"learner": learner})
    _run(run_named_services(settings, ["learner"]))


def _progress_bars(*, counts: bool = False) -> Progress:
    """Progress bars on stderr: description, bar, [done/total,] a detail field, time."""
    columns = [TextColumn("{task.description}"), BarColumn()]
    if counts:
        columns.append(TextColumn("{task.completed}/{task.total}"))
    columns += [TextColumn("{task.fields[detail]}"), TimeElapsedColumn()]
    return Progress(*columns, console=err_console)


@app.command("run")
@_one_line_errors
def run_loop(
    config: ConfigOption = None,
    rounds: Annotated[int, typer.Option(help="Alternation rounds.")] = 1,
    steps_per_turn: Annotated[int, typer.Option(help="Training steps per role per round.")] = 1,
    group_size: Annotated[int, typer.Option(help="Kernels sampled per module (G).")] = 2,
    groups_per_step: Annotated[int, typer.Option(help="Complete groups per training step.")] = 2,
    max_new_tokens: Annotated[int, typer.Option(help="Completion length cap.")] = 640,
    temperature: Annotated[
        float | None,
        typer.Option(help="Sampling temperature of both generators (and so of the learner's "
                          "importance ratios); default: the settings' (1.0)."),
    ] = None,
    time_limit: Annotated[float, typer.Option(help="Stop after this many seconds.")] = 3600.0,
) -> None:
    """Runs the whole co-evolution loop in one process (embedded default: in-memory bus,
    SQLite, SmolLM2 on the CPU, Triton through its interpreter)."""
    from kz_stream.app import RunOptions, RunReport, run_coevolution

    settings = _settings(config, quiet=True)
    options = RunOptions(
        rounds=rounds,
        steps_per_turn=steps_per_turn,
        group_size=group_size,
        groups_per_step=groups_per_step,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        time_limit_s=time_limit,
    )
    try:
        options.apply(settings)  # refused here, before anything starts, if impossible
    except ValidationError as e:
        raise _bad_option(e) from None
    total_steps = rounds * steps_per_turn * len(options.order)
    shown_rounds: set[int] = set()

    with _progress_bars() as progress:
        steps = progress.add_task("training steps", total=total_steps, detail="")
        events = progress.add_task("events", total=None, detail="")

        def tick(report: RunReport) -> None:
            c = report.counts
            progress.update(
                steps, completed=len(report.steps), detail=f"{len(report.steps)}/{total_steps}"
            )
            progress.update(
                events,
                detail=(
                    f"modules {c.get('ModuleProposed', 0)}  kernels {c.get('KernelGenerated', 0)}  "
                    f"verdicts {c.get('KernelVerified', 0)}"
                ),
            )
            for rnd in sorted({s["round"] for s in report.steps}):
                done = [s for s in report.steps if s["round"] == rnd]
                if rnd not in shown_rounds and len(done) == steps_per_turn * len(options.order):
                    shown_rounds.add(rnd)
                    progress.console.print(_round_table(rnd, done, report))

        started, t0 = datetime.now(UTC), time.monotonic()
        try:
            report = _run(run_coevolution(settings, options, on_tick=tick))
        except (KeyboardInterrupt, Exception) as e:
            # Ctrl-C before the services' handlers were in place, or a failure: the store
            # still tells what the run did. The error's own line follows (_one_line_errors).
            progress.stop()
            interrupted = isinstance(e, KeyboardInterrupt)
            _print_summary_after(settings, options, config, started, time.monotonic() - t0,
                                 "interrupted" if interrupted else "error")
            if interrupted:
                raise typer.Exit(130) from None
            raise
    assert report.summary is not None  # run_coevolution returns with it
    # The session's wall time as the user saw it: stopping waits for threads still busy
    # (a model load, a training step) after the summary was read.
    _print_summary(replace(report.summary, session_seconds=time.monotonic() - t0), options,
                   config)
    if report.outcome == "interrupted":
        raise typer.Exit(130)
    if report.outcome != "finished":
        raise typer.Exit(1)


def _rerun_command(options: RunOptions, config: Path | None) -> str:
    """The ``kz run`` command line with ``options``: run again, it resumes the run."""
    from kz_stream.app import RunOptions

    default = RunOptions()
    parts = ["kz run"] + ([f"--config {config}"] if config else [])
    for name, flag in (("rounds", "--rounds"), ("steps_per_turn", "--steps-per-turn"),
                       ("group_size", "--group-size"), ("groups_per_step", "--groups-per-step"),
                       ("max_new_tokens", "--max-new-tokens"), ("temperature", "--temperature"),
                       ("time_limit_s", "--time-limit")):
        value = getattr(options, name)
        if value != getattr(default, name):
            parts.append(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}")
    return " ".join(parts)


def _print_summary(summary: RunSummary, options: RunOptions, config: Path | None) -> None:
    from kz_stream.summary import next_commands, render_summary

    commands = next_commands(summary, config=config, rerun=_rerun_command(options, config))
    console.print(render_summary(summary, commands))


def _print_summary_after(settings: Settings, options: RunOptions, config: Path | None,
                         started: datetime, seconds: float, outcome: Outcome) -> None:
    """Prints the summary of a run that ``run_coevolution`` did not return from, when the
    store can be read and holds any of it; otherwise nothing (the error says enough)."""
    from kz_stream.app import load_summary

    try:
        summary = _read_store(settings, lambda store: load_summary(
            store, options.apply(settings), outcome=outcome, session_seconds=seconds,
            session_started=started))
    except Exception:  # a store that cannot be read: the run's own error is the news
        return
    if summary.position:
        _print_summary(summary, options, config)


def _round_table(rnd: int, steps: list[dict[str, Any]], report: Any) -> Table:
    table = Table(
        "step",
        "role",
        "trained",
        "policy v",
        "samples",
        "mean reward",
        "seconds",
        title=f"round {rnd + 1}",
    )
    for s in steps:
        table.add_row(
            str(s["step"]),
            str(s["role"]),
            str(s["trained"]),
            str(s["policy_version"]),
            str(s["samples"]),
            f"{s['mean_reward']:.3f}",
            f"{s['seconds']:.1f}",
        )
    table.caption = f"verdicts so far: {report.statuses}"
    return table


verify_app = typer.Typer(help="The kernel verifier on its own.")
app.add_typer(verify_app, name="verify")


@verify_app.command("audit-suite")
@_one_line_errors
def verify_audit_suite(
    path: Annotated[Path, typer.Argument(help="A folder of KernelBench-format problems "
                                         "(e.g. a KernelBench checkout's KernelBench/level1).")],
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the rows here.")] = None,
    admission: Annotated[bool, typer.Option(help="Run the admission gate too.")] = True,
    limit: Annotated[int | None, typer.Option(help="Only the first N problems.")] = None,
    cpu: Annotated[bool, typer.Option("--cpu", help="Force the CPU path.")] = False,
) -> None:
    """Prepares every problem of a suite as the verifier would and prints, per problem:
    admitted or why not, the input sets used and dropped, the memory plan, the oracle's
    peak device memory and time."""
    from kz_stream.verify import Verifier, VerifierConfig, audit_suite, suite_files

    if not path.is_dir():
        raise typer.BadParameter(f"{path} is not a folder", param_hint="PATH")
    files = suite_files(path)[:limit]
    if not files:
        raise typer.BadParameter(f"no problem files (*.py) in {path}", param_hint="PATH")
    table = Table(title=f"{path}: {len(files)} problems")
    for col in ("problem", "admission", "input sets", "dropped", "memory plan",
                "oracle GiB", "input GiB", "prepare s"):
        table.add_column(col)
    rows: list[dict[str, Any]] = []

    async def go() -> None:
        verifier = Verifier(VerifierConfig(devices=[] if cpu else None))
        device = "cuda" if verifier.gpu else "cpu"
        try:
            with Progress(TextColumn("{task.description}"), BarColumn(),
                          TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                          console=err_console, transient=True) as bar:
                task = bar.add_task("audit", total=len(files))
                async for row in audit_suite(files, verifier, admission=admission,
                                             admission_device=device):
                    rows.append(row.to_dict())
                    adm = ("-" if row.admitted is None else "yes" if row.admitted
                           else f"no: {row.reason}")
                    table.add_row(
                        row.name, adm, row.error or ", ".join(row.input_sets),
                        "; ".join(f"{d['label']}: {d['reason'][:60]}" for d in row.dropped)
                        or "-", str(len(row.memory_plan)) if row.memory_plan else "-",
                        f"{row.oracle_peak_gb:.1f}", f"{row.input_gb:.2f}",
                        f"{row.prepare_s:.1f}")
                    bar.advance(task, 1)
                    if json_out is not None:  # rewritten as it goes: a cut run keeps its rows
                        json_out.write_text(json.dumps(rows, indent=1))
        finally:
            await verifier.close()

    _run(go())
    console.print(table)
    failed = sum(1 for r in rows if r["error"])
    rejected = sum(1 for r in rows if r["admitted"] is False)
    dropped = sum(len(r["dropped"]) for r in rows)
    console.print(f"{len(rows)} problems: {failed} could not be prepared, {rejected} not "
                  f"admitted, {dropped} input sets dropped (each named above).")
# ---------------------------------------------------------------------------------- eval


@eval_app.command("run")
@_one_line_errors
def eval_run(
    suite: Annotated[Path, typer.Argument(help="Folder of KernelBench-format problems.")],
    policy: Annotated[
        str,
        typer.Option(help="base | a model or LoRA adapter folder | run:<run id>[:<version>] "
                          "| an OpenAI-compatible URL."),
    ] = "base",
    backend: Annotated[str, typer.Option(help="Kernel language: triton or cuda.")] = "triton",
    samples: Annotated[int, typer.Option(min=1, help="Samples per problem.")] = 10,
    run_id: Annotated[
        str | None, typer.Option(help="Resume this run (eval-...); default: a new one.")
    ] = None,
    level: Annotated[int | None, typer.Option(help="Level (default: from the folder).")] = None,
    match: Annotated[str | None, typer.Option(help="Only files matching this glob.")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="First N problems per level.")] = None,
    model: Annotated[
        str | None,
        typer.Option(help="Served model name (URL policy) or base model folder (others)."),
    ] = None,
    api_key_env: Annotated[
        str, typer.Option(help="Environment variable holding the endpoint's API key.")
    ] = "OPENAI_API_KEY",
    max_new_tokens: Annotated[int | None, typer.Option(min=1, help="Completion cap.")] = None,
    temperature: Annotated[float | None, typer.Option(min=0.0, help="Temperature.")] = None,
    seed: Annotated[int | None, typer.Option(help="Sampling seed.")] = None,
    concurrency: Annotated[
        int, typer.Option(min=1, help="Generations and verifications in flight at once.")
    ] = 4,
    device: Annotated[
        str | None, typer.Option(help="Where a local model generates (cpu, cuda).")
    ] = None,
    batch_size: Annotated[
        int, typer.Option(min=1, help="A local model's generation batch (prompt x sample).")
    ] = 8,
    config: ConfigOption = None,
) -> None:
    """Samples the policy on every problem, verifies every kernel and stores it all as
    events; run again with --run-id to resume one that was cut short."""
    from kz_stream.evaluation import (
        EvalOptions,
        EvalProgress,
        load_suite,
        new_run_id,
        run_evaluation,
    )
    from kz_stream.llm import SamplingParams

    if not _is_backend(backend):
        raise typer.BadParameter(f"--backend: {backend!r} is not triton or cuda")
    settings = _settings(config, quiet=True)
    loaded = load_suite(suite, level=level, match=match, limit=limit)
    for path, why in loaded.skipped:
        err_console.print(f"skipped {path.name}: {why}", highlight=False)
    llm = settings.coder.llm
    options = EvalOptions(
        run_id=run_id or new_run_id(),
        policy=policy,
        backend=backend,
        samples=samples,
        sampling=SamplingParams(
            max_tokens=max_new_tokens or llm.max_tokens,
            temperature=llm.temperature if temperature is None else temperature,
            seed=seed,
        ),
        model=model,
        api_key=os.environ.get(api_key_env),
        concurrency=concurrency,
        device=device,
        batch_size=batch_size,
    )
    console.print(
        f"evaluation {options.run_id}: {len(loaded.problems)} problems × {samples} samples",
        highlight=False,
    )
    with _progress_bars(counts=True) as bars:
        gen = bars.add_task("generated", total=None, detail="")
        ver = bars.add_task("verified", total=None, detail="")

        def show(p: EvalProgress) -> None:
            bars.update(gen, total=p.to_generate, completed=p.generated)
            bars.update(ver, total=p.to_verify, completed=p.verified,
                        detail=f"correct {p.correct}" + (f", {p.resumed} stored before"
                                                         if p.resumed else ""))

        progress = _run(run_evaluation(settings, loaded, options, on_progress=show))
    console.print(
        f"evaluation {options.run_id}: {progress.verified} kernels verified now "
        f"({progress.correct} correct), {progress.resumed} before; "
        f"kz eval report {options.run_id}",
        highlight=False,
    )


@eval_app.command("report")
@_one_line_errors
def eval_report(
    run_id: Annotated[str, typer.Argument(help="The evaluation run id (eval-...).")],
    out: Annotated[
        Path | None, typer.Option(help="Output folder (default .kz/eval/<run id>).")
    ] = None,
    config: ConfigOption = None,
) -> None:
    """Prints an evaluation's metrics per level and overall, and writes report.json,
    report.md and plots (pass@k against k, speedups, the per-problem grid)."""
    from kz_stream.evaluation import build_report, load_evaluation, table_rows, write_report

    settings = _settings(config)
    out = out or Path(".kz/eval") / run_id
    with _progress_bars() as bars:
        task = bars.add_task("reading the store", total=None, detail="")
        record = _read_store(settings, lambda store: load_evaluation(store, run_id))
        if record is None:
            raise LookupError(f"no evaluation {run_id!r} in {redact(settings.database_url)}")
        bars.update(task, description="metrics and plots", total=1)
        report = build_report(record)
        paths = write_report(report, out)
        bars.update(task, completed=1)
    header, rows = table_rows(report)
    done = f"{report.verified}/{report.expected} kernels verified"
    table = Table(*header, title=f"evaluation {run_id} ({done})")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print("statuses: " + ", ".join(f"{k} {v}" for k, v in report.statuses.items()),
                  highlight=False)
    console.print(f"wrote {', '.join(p.name for p in paths)} to {out}", highlight=False)


# ------------------------------------------------------------------------------- dataset


def _kernel_filter(runs: list[str] | None, statuses: list[str] | None, include_eval: bool,
                   since: datetime | None, until: datetime | None,
                   verifier_versions: list[str] | None = None) -> KernelFilter:
    """The stored kernels the filter options choose (kz dataset export, kz rescore)."""
    from kz_stream.export import KernelFilter

    return KernelFilter(runs=set(runs or ()), statuses=set(statuses or ()),
                        verifier_versions=set(verifier_versions or ()),
                        include_evaluation=include_eval, since=_utc(since), until=_utc(until))


def _utc(moment: datetime | None) -> datetime | None:
    """A command-line time, read as UTC when it names no zone."""
    return moment.replace(tzinfo=UTC) if moment and moment.tzinfo is None else moment


@dataset_app.command("export")
@_one_line_errors
def dataset_export(
    out: Annotated[Path, typer.Argument(help="Output folder (parquet files and README.md).")],
    sets: Annotated[
        list[str] | None, typer.Option("--set", help="sft, verdicts, rl (default all).")
    ] = None,
    run: RunsOption = None,
    status: Annotated[
        list[str] | None, typer.Option(help="Only verdicts with these statuses.")
    ] = None,
    verifier_version: Annotated[
        list[str] | None, typer.Option(help="Only verdicts of these verifier versions.")
    ] = None,
    include_eval: IncludeEvalOption = False,
    since: SinceOption = None,
    until: UntilOption = None,
    chunk_rows: Annotated[
        int | None, typer.Option(min=1, help="Rows per parquet row group, and verdict rows "
                                 "held at once before writing (default 1,000).")
    ] = None,
    config: ConfigOption = None,
) -> None:
    """Writes the SFT set (best correct kernel per module and backend), the verdict set
    (every verdict with its kernel) and the RL set (modules with their per-API frontier
    statistics) as parquet with a dataset card, replaying the store."""
    from kz_stream.export import CHUNK_ROWS, DATASETS, DatasetName, export_datasets

    names: list[DatasetName] = []
    for name in dict.fromkeys(sets or DATASETS):
        if name not in DATASETS:
            raise typer.BadParameter(f"--set: {name!r} is not one of {', '.join(DATASETS)}")
        names.append(name)
    flt = _kernel_filter(run, status, include_eval, since, until, verifier_version)
    settings = _settings(config)
    with _progress_bars(counts=True) as bars:
        task = bars.add_task("replaying the store", total=None, detail="")

        counts, position = _read_store(settings, lambda store: export_datasets(
            store, out, names, flt=flt, store_url=settings.database_url,
            chunk_rows=chunk_rows or CHUNK_ROWS,
            on_batch=lambda pos, end: bars.update(task, completed=pos, total=end)))
    console.print(
        ", ".join(f"{name}: {n:,} rows" for name, n in counts.items())
        + f" (store position {position:,}) written to {out}",
        highlight=False,
    )


# ------------------------------------------------------------------------------- rescore


@app.command("rescore")
@_one_line_errors
def rescore_cmd(
    run: RunsOption = None,
    status: Annotated[
        list[str] | None, typer.Option(help="Only kernels whose newest verdict has this status.")
    ] = None,
    since: SinceOption = None,
    until: UntilOption = None,
    include_eval: IncludeEvalOption = False,
    fleet: Annotated[
        bool | None,
        typer.Option("--fleet/--local", help="Jobs on the rescore topic for the verifier "
                     "services, or verify in this process (default: --fleet on a broker, "
                     "--local on the embedded bus)."),
    ] = None,
    timeout: Annotated[
        float, typer.Option(min=0, help="--fleet: seconds to wait for the verdicts.")
    ] = 3600.0,
    concurrency: Annotated[
        int, typer.Option(min=1, help="--local: kernels in verification at once.")
    ] = 4,
    out: Annotated[Path | None, typer.Option(help="Write the drift as JSON here.")] = None,
    config: ConfigOption = None,
) -> None:
    """Verifies stored kernels again under the current verifier version (new verdicts beside
    the old; already judged ones are skipped) and reports which verdicts flipped, by check,
    and the training steps that used them."""
    from kz_stream.app import make_verifier, open_context
    from kz_stream.consumers.verifier import rescore_group
    from kz_stream.rescore import Drift, plan_rescore, rescore, rescore_on_fleet
    from kz_stream.verify import VERIFIER_VERSION

    settings = _settings(config, quiet=True)
    flt = _kernel_filter(run, status, include_eval, since, until)
    on_fleet = not settings.embedded if fleet is None else fleet
    if on_fleet and settings.embedded:
        raise ValueError("--fleet: the embedded bus (memory://) lives inside one process; set "
                         "KZ_BUS_URL to the broker the verifiers read, or use --local")

    async def go() -> Drift:
        async with open_context(settings) as ctx:
            plan = await plan_rescore(ctx.store, flt)
            todo = len(plan.todo())
            console.print(f"{todo} of {len(plan.kernels)} kernels to verify under "
                          f"{VERIFIER_VERSION}", highlight=False)
            if on_fleet and todo:
                console.print(f"jobs on {settings.topics.rescore} for the consumer group "
                              f"{rescore_group()}", highlight=False)
            with _progress_bars(counts=True) as bars:
                task = bars.add_task("verified", total=todo, detail="")

                def progress(done: int, _: int) -> None:
                    bars.update(task, completed=done)

                if on_fleet:
                    return await rescore_on_fleet(
                        ctx.store, ctx.bus, plan, topic=settings.topics.rescore,
                        timeout_s=timeout, on_verdict=progress)
                return await rescore(
                    ctx.store, make_verifier(settings), plan, producer=ctx.producer_id,
                    concurrency=concurrency, on_verdict=progress)

    d = _run(go())
    table = Table("from", "to", "check", "kernels",
                  title=f"{len(d.flipped_kernels)} of {d.compared} verdicts flipped")
    for row in d.as_dict()["flips"]:
        table.add_row(row["from"], row["to"], row["check"], str(row["kernels"]))
    console.print(table)
    if d.steps:
        steps = Table("role", "step", "policy version", "flipped kernels used",
                      title="training steps whose rewards used a flipped verdict")
        for s in d.steps:
            steps.add_row(s["role"], str(s["step"]), str(s["policy_version"]),
                          str(len(s["flipped_kernels"])))
        console.print(steps)
    if out is not None:
        out.write_text(json.dumps(d.as_dict(), indent=2) + "\n")
        console.print(f"drift written to {out}", highlight=False)
    if d.missing:
        err_console.print(
            f"{len(d.missing)} of {d.rescored + len(d.missing)} verdicts did not come within "
            f"{timeout:g}s (are verifiers of {VERIFIER_VERSION} running?); their jobs stay "
            "queued: run kz rescore again to wait for them", highlight=False)
        raise typer.Exit(1)


# ------------------------------------------------------------------------------ warmstart


@warmstart_app.command("data")
@_one_line_errors
def warmstart_data(
    out: Annotated[Path, typer.Argument(help="Data folder (created; a rerun resumes it).")],
    count: Annotated[int, typer.Option(min=1, help="Modules to synthesize.")] = 600,
    seed: Annotated[int, typer.Option(help="Synthesizer seed.")] = 0,
    held_out: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Share of modules held out (by hash).")
    ] = 0.15,
    workers: Annotated[int, typer.Option(min=1, help="Modules validated at once.")] = 2,
    concurrency: Annotated[int, typer.Option(min=1, help="Teacher kernels verified at once.")] = 2,
    config: ConfigOption = None,
) -> None:
    """Synthesizes modules from the API catalog, validates them as proposals, has the Triton
    teacher write a kernel for each training module (stored and verified as an evaluation
    run), and writes the Coder and Proposer SFT sets."""
    from kz_stream.evaluation import EvalOptions, EvalProgress, load_suite, run_evaluation
    from kz_stream.llm import SamplingParams
    from kz_stream.warmstart.data import synthesize_suite, teacher_run_id, write_sft_sets

    settings = _settings(config, quiet=True)
    started = time.monotonic()
    with _progress_bars(counts=True) as bars:
        task = bars.add_task("modules validated", total=count, detail="")
        summary = synthesize_suite(
            out, count=count, seed=seed, held_out=held_out, workers=workers,
            on_module=lambda done, total: bars.update(task, completed=done),
        )
        bars.update(task, completed=count,
                    detail=f"{summary.valid} valid ({summary.train} train, "
                           f"{summary.held_out} held out)")
    console.print(
        f"modules: {summary.valid}/{summary.modules} valid"
        + (f"; invalid: {summary.invalid_reasons}" if summary.invalid_reasons else ""),
        highlight=False)
    run_id = teacher_run_id(out)
    options = EvalOptions(run_id=run_id, policy="teacher", samples=1, concurrency=concurrency,
                          sampling=SamplingParams(max_tokens=1, temperature=0.0))
    with _progress_bars(counts=True) as bars:
        ver = bars.add_task("teacher kernels verified", total=None, detail="")

        def show(p: EvalProgress) -> None:
            bars.update(ver, total=p.to_verify, completed=p.verified,
                        detail=f"correct {p.correct}")

        _run(run_evaluation(settings, load_suite(out / "train"), options, on_progress=show))

    counts = _read_store(settings, lambda store: write_sft_sets(out, store))
    console.print(
        f"teacher run {run_id}: {counts['coder']} Coder examples, {counts['proposer']} Proposer "
        f"examples in {out} ({time.monotonic() - started:.0f} s); next: "
        f"kz warmstart train {out}/coder_sft.jsonl --out ADAPTER; "
        f"kz eval report {run_id}",
        highlight=False)


@warmstart_app.command("train")
@_one_line_errors
def warmstart_train(
    data: Annotated[Path, typer.Argument(help="coder_sft.jsonl or proposer_sft.jsonl.")],
    out: Annotated[Path, typer.Option(help="Adapter (or model) folder to write.")],
    role: Annotated[str, typer.Option(help="coder or proposer (recorded in the card).")] = "coder",
    base_model: Annotated[
        str | None, typer.Option(help="Base model folder (default: the embedded SmolLM2).")
    ] = None,
    full: Annotated[bool, typer.Option(help="Full fine-tune instead of LoRA.")] = False,
    epochs: Annotated[float, typer.Option(min=0.0, help="Passes over the data.")] = 3.0,
    learning_rate: Annotated[float, typer.Option(min=0.0, help="Peak learning rate.")] = 2e-4,
    batch_size: Annotated[int, typer.Option(min=1, help="Rows per device step.")] = 8,
    max_length: Annotated[int, typer.Option(min=16, help="Token cap per row.")] = 4096,
    limit: Annotated[int | None, typer.Option(min=1, help="First N rows only.")] = None,
    seed: Annotated[int, typer.Option(help="Training seed.")] = 0,
) -> None:
    """Fine-tunes the base model on a warm-start set with TRL's SFTTrainer and writes the
    adapter with its card (warmstart.json)."""
    from kz_stream.warmstart.train import SFTOptions, train_sft

    if role not in ("coder", "proposer"):
        raise typer.BadParameter(f"--role: {role!r} is not coder or proposer")
    command = "kz warmstart train " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else ""
    card = train_sft(SFTOptions(
        data=data, out=out, role=role, base_model=base_model, full_finetune=full,
        epochs=epochs, learning_rate=learning_rate, batch_size=batch_size,
        max_length=max_length, limit=limit, seed=seed, command=command,
    ))
    m = card["metrics"]
    console.print(
        f"{role} {card['kind']} on {card['data']['rows']} rows: loss {m['first_loss']} -> "
        f"{m['last_loss']} in {m['steps']} steps ({m['seconds']} s); wrote {out}",
        highlight=False)


@warmstart_app.command("proposer-eval")
@_one_line_errors
def warmstart_proposer_eval(
    policy: Annotated[str, typer.Option(help="base | a LoRA adapter or model folder.")] = "base",
    sets: Annotated[int, typer.Option(min=1, help="API sets to sample (one module each).")] = 100,
    seed: Annotated[int, typer.Option(help="Sampler and sampling seed.")] = 0,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Completion cap.")] = 768,
    temperature: Annotated[float, typer.Option(min=0.0, help="Temperature.")] = 1.0,
    device: Annotated[str | None, typer.Option(help="Where the model generates.")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Generation batch.")] = 8,
    workers: Annotated[int, typer.Option(min=1, help="Modules validated at once.")] = 2,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the score here.")] = None,
) -> None:
    """The Proposer's valid-module rate: one module per sampled API set, each validated as
    the Proposer service validates proposals."""
    from kz_stream.evaluation import EvalOptions, open_policy
    from kz_stream.llm import SamplingParams
    from kz_stream.warmstart.proposer_eval import score_proposer

    sampling = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed)
    options = EvalOptions(run_id="eval-proposer", policy=policy, device=device,
                          batch_size=batch_size, sampling=sampling)

    async def go() -> Any:
        backend = await open_policy(policy, None, options)
        async with backend:
            with _progress_bars(counts=True) as bars:
                task = bars.add_task("modules validated", total=sets, detail="")
                return await score_proposer(
                    backend, sets=sets, seed=seed, sampling=sampling, workers=workers,
                    on_progress=lambda d, t: bars.update(task, completed=d, total=t))

    score = _run(go())
    result = {"policy": policy, "sets": score.sets, "valid": score.valid,
              "valid_rate": round(score.valid_rate, 4),
              "buildable_sets": score.buildable_sets, "buildable_valid": score.buildable_valid,
              "buildable_valid_rate": round(score.buildable_valid_rate, 4),
              "reasons": dict(score.reasons.most_common())}
    console.print(
        f"Proposer {policy}: {score.valid}/{score.sets} valid ({score.valid_rate:.1%}); on the "
        f"synthesizer's sets {score.buildable_valid}/{score.buildable_sets}; reasons "
        f"{result['reasons']}", highlight=False)
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
