"""``kz dataset export`` and ``kz rescore``: the stored kernels, chosen by the filter options."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from kz_stream.cli._common import ConfigOption, _read_store, _run, _settings
from kz_stream.cli._output import _one_line_errors, _progress_bars, console, err_console

if TYPE_CHECKING:
    from kz_stream.export import KernelFilter

dataset_app = typer.Typer(help="Hugging Face datasets replayed from the event store.")

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


def _kernel_filter(runs: list[str] | None, statuses: list[str] | None, include_eval: bool,
                   since: datetime | None, until: datetime | None,
                   verifier_versions: list[str] | None = None) -> KernelFilter:
    """The stored kernels the filter options choose (kz dataset export, kz rescore); a
    status that is none, or an empty time window, is refused (it chose nothing, silently)."""
    from kz_stream.events import VerdictStatus
    from kz_stream.export import KernelFilter

    known = [s.value for s in VerdictStatus]
    for name in statuses or ():
        if name not in known:
            raise typer.BadParameter(f"{name!r} is not a verdict status: {', '.join(known)}",
                                     param_hint="--status")
    since, until = _utc(since), _utc(until)
    if since is not None and until is not None and since >= until:
        raise typer.BadParameter(f"--since {since} is not before --until {until}: no kernel "
                                 "is in that window")

    return KernelFilter(runs=set(runs or ()), statuses=set(statuses or ()),
                        verifier_versions=set(verifier_versions or ()),
                        include_evaluation=include_eval, since=since, until=until)


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
    if not any(counts.values()) and (run or verifier_version or status or since or until):
        err_console.print("warning: the filters matched nothing in this store (is each --run "
                          "and --verifier-version one it holds?)",
                          highlight=False)


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
    if d.undecided:
        console.print(f"{d.undecided} of the {d.judged} verdicts of {VERIFIER_VERSION} are "
                      "undecided (unchecked, or the verifier's own failure): compared with "
                      "nothing; an infra_error is judged again by the next kz rescore",
                      highlight=False)
    if d.unjudged:
        console.print(f"{d.unjudged} kernels have no verdict yet: their run's verifier gives "
                      "the first (a run resumed with kz run judges them)", highlight=False)
    if out is not None:
        out.write_text(json.dumps(d.as_dict(), indent=2) + "\n")
        console.print(f"drift written to {out}", highlight=False)
    if d.missing:
        err_console.print(
            f"{len(d.missing)} of {d.rescored + len(d.missing)} verdicts did not come within "
            f"{timeout:g}s (are verifiers of {VERIFIER_VERSION} running?); their jobs stay "
            "queued: run kz rescore again to wait for them", highlight=False)
        raise typer.Exit(1)
