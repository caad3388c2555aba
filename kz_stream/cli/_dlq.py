"""``kz dlq``: inspect and re-drive dead letters."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.table import Table

from kz_stream.cli._common import ConfigOption, _run, _settings
from kz_stream.cli._output import _one_line_errors, console
from kz_stream.config import Settings

dlq_app = typer.Typer(help="Inspect and re-drive dead letters.")

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
