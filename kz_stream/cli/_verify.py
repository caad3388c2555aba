"""``kz verify``: the kernel verifier on its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kz_stream.cli._common import _run
from kz_stream.cli._output import _one_line_errors, console, err_console

verify_app = typer.Typer(help="The kernel verifier on its own.")


def _slowest(phase_s: dict[str, float], n: int = 2) -> str:
    """The ``n`` phases a preparation spent most in ("float64 31.2, reply 9.8")."""
    parts = sorted(((v, k) for k, v in phase_s.items() if k != "oracle"), reverse=True)[:n]
    return ", ".join(f"{k} {v:.1f}" for v, k in parts) or "-"


@verify_app.command("audit-suite")
@_one_line_errors
def verify_audit_suite(
    path: Annotated[Path, typer.Argument(help="A folder of KernelBench-format problems "
                                         "(e.g. a KernelBench checkout's KernelBench/level1).")],
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the rows here.")] = None,
    admission: Annotated[bool, typer.Option(help="Run the admission gate too.")] = True,
    limit: Annotated[int | None, typer.Option(help="Only the first N problems.")] = None,
    cpu: Annotated[bool, typer.Option("--cpu", help="Force the CPU path.")] = False,
    jobs: Annotated[int, typer.Option(min=1, help="Problems audited at once (each with its "
                                      "own oracle; a GPU's memory is shared).")] = 1,
    resume: Annotated[bool, typer.Option(help="Keep the rows the --json file holds for "
                                         "problems whose source and verifier version are "
                                         "unchanged; audit the rest.")] = False,
    retry_errors: Annotated[bool, typer.Option(help="Resume, and audit again the problems "
                                               "that could not be prepared.")] = False,
    redo: Annotated[list[str] | None, typer.Option(
        help="Resume, and audit this problem again (its file's name without .py; "
        "repeatable) whatever its row says.")] = None,
    time_limit: Annotated[float | None, typer.Option(
        min=0, help="Start no problem after this many seconds (those begun finish); "
        "--resume goes on from there.")] = None,
) -> None:
    """Prepares every problem of a suite as the verifier would and prints, per problem:
    admitted or why not, the input sets used and dropped, the memory plan, the oracle's
    peak device memory, the host memory its sets hold and the host budget's reservation
    for it, and the time."""
    from kz_stream.verify import (
        ProblemAudit,
        Verifier,
        VerifierConfig,
        audit_suite,
        still_to_audit,
        suite_files,
    )
    from kz_stream.verify._hardware import manifest

    if not path.is_dir():
        raise typer.BadParameter(f"{path} is not a folder", param_hint="PATH")
    redo = list(redo or [])
    resume = resume or bool(redo)
    if (resume or retry_errors) and json_out is None:
        raise typer.BadParameter("needs --json FILE: the rows to go on from",
                                 param_hint="--resume")
    files = suite_files(path)[:limit]
    if not files:
        raise typer.BadParameter(f"no problem files (*.py) in {path}", param_hint="PATH")
    unknown = sorted(set(redo) - {f.stem for f in files})
    if unknown:
        raise typer.BadParameter(f"no problem {', '.join(unknown)} in this selection of "
                                 f"{path}", param_hint="--redo")
    kept: dict[str, ProblemAudit] = {}
    todo = files
    order = {f.stem: i for i, f in enumerate(files)}
    others: list[ProblemAudit] = []  # rows of problems outside this selection: kept as they are
    if (resume or retry_errors) and json_out is not None and json_out.exists():
        try:
            earlier = [ProblemAudit.from_dict(r) for r in json.loads(json_out.read_text())]
        except (ValueError, TypeError, AttributeError) as e:
            raise typer.BadParameter(
                f"{json_out} holds no audit rows to go on from ({type(e).__name__}: {e}); "
                "move it aside or name another file", param_hint="--json") from e
        todo, kept = still_to_audit(files, earlier, retry_errors=retry_errors, redo=redo)
        others = [r for r in earlier if r.name not in order]
    table = Table(title=f"{path}: {len(todo)} of {len(files)} problems to audit")
    for col in ("problem", "admission", "input sets", "dropped", "memory plan",
                "oracle GiB", "input GiB", "host GiB (reserved)", "prepare s",
                "slowest phases (s)"):
        table.add_column(col)
    rows: dict[str, ProblemAudit] = dict(kept)

    def write_rows() -> None:
        # Rewritten as it goes, so a cut run keeps its rows; whole or not at all (a file cut
        # mid-write would stop the next --resume).
        if json_out is not None:
            ordered = sorted(rows.values(), key=lambda r: order[r.name]) + others
            tmp = json_out.with_name(json_out.name + ".tmp")
            tmp.write_text(json.dumps([r.to_dict() for r in ordered], indent=1))
            tmp.replace(json_out)

    async def go() -> None:
        verifier = Verifier(VerifierConfig(devices=[] if cpu else None, oracles=jobs))
        machine = (manifest()["gpu"] or "cuda") if verifier.gpu else "cpu"
        try:
            with Progress(TextColumn("{task.description}"), BarColumn(),
                          TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                          console=err_console, transient=True) as bar:
                task = bar.add_task("audit", total=len(todo))
                async for row in audit_suite(todo, verifier, admission=admission, jobs=jobs,
                                             time_limit_s=time_limit):
                    row.machine = machine
                    rows[row.name] = row
                    bar.advance(task, 1)
                    write_rows()
        finally:
            await verifier.close()

    _run(go())
    write_rows()
    # Rows arrive as problems finish; the table lists this run's in the suite's order.
    for row in sorted((r for r in rows.values() if r.name not in kept),
                      key=lambda r: order[r.name]):
        adm = ("-" if row.admitted is None else
               ("yes" if row.admitted else f"no: {row.reason}")
               + f", {row.admission_s:.1f} s ({_slowest(row.admission_phase_s)})")
        table.add_row(
            row.name, adm, row.error or ", ".join(row.input_sets),
            "; ".join(f"{d['label']}: {d['reason'][:60]}" for d in row.dropped) or "-",
            str(len(row.memory_plan)) if row.memory_plan else "-",
            f"{row.oracle_peak_gb:.1f}", f"{row.input_gb:.2f}",
            f"{row.host_bytes / 2**30:.2f} ({row.reserved_bytes / 2**30:.1f})",
            f"{row.prepare_s:.1f}", _slowest(row.phase_s))
    console.print(table)
    left = len(files) - len(rows)
    failed = sum(1 for r in rows.values() if r.error)
    rejected = sum(1 for r in rows.values() if r.admitted is False)
    dropped = sum(len(r.dropped) for r in rows.values())
    if kept:
        console.print(f"{len(kept)} rows kept from {json_out} (same source and verifier "
                      f"version), {len(rows) - len(kept)} audited now.")
    console.print(f"{len(rows)} problems: {failed} could not be prepared, {rejected} not "
                  f"admitted, {dropped} input sets dropped (each named above).")
    if left:
        console.print(f"{left} problems not audited: the time limit came first. Run the "
                      "same command with --resume to go on.")
