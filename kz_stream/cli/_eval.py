"""``kz eval``: evaluate a Coder policy on a KernelBench-format suite."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, get_args

import typer
from rich.table import Table

from kz_stream.cli._common import ConfigOption, _read_store, _run, _settings
from kz_stream.cli._output import _one_line_errors, _progress_bars, console, err_console
from kz_stream.database_url import redact
from kz_stream.llm import KVCache
from kz_stream.verify import Backend

if TYPE_CHECKING:
    from kz_stream.evaluation import SuiteMetrics

eval_app = typer.Typer(help="Evaluate a Coder policy on a KernelBench-format suite.")


def _one_of(flag: str, value: str, literal: object) -> Any:
    """Returns ``value`` if it is one of the ``Literal`` type's values (typer has no
    Literal options)."""
    choices = get_args(literal)
    if value not in choices:
        raise typer.BadParameter(f"{flag}: {value!r} is not one of {', '.join(choices)}")
    return value


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
        int, typer.Option(min=1, help="Problems sampled at once (at least enough to fill "
                                      "--batch-size); their samples verified at once.")
    ] = 4,
    device: Annotated[
        str | None, typer.Option(help="Where a local model generates (cpu, cuda).")
    ] = None,
    batch_size: Annotated[
        int, typer.Option(min=1, help="A local model's generation batch (prompt x sample).")
    ] = 8,
    kv_cache: Annotated[
        str | None,
        typer.Option(help="A local model's KV cache: dynamic, static or compiled (static, "
                          "decode step under torch.compile; CUDA). Default: [coder.llm]."),
    ] = None,
    compile_baseline: Annotated[
        bool,
        typer.Option(help="Also time each problem's reference under torch.compile (on a "
                          "GPU, once per problem with a timed kernel) for speedups vs compile."),
    ] = True,
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

    backend_name: Backend = _one_of("--backend", backend, Backend)
    cache: KVCache | None = None if kv_cache is None else _one_of("--kv-cache", kv_cache, KVCache)
    settings = _settings(config, quiet=True)
    loaded = load_suite(suite, level=level, match=match, limit=limit)
    for path, why in loaded.skipped:
        err_console.print(f"skipped {path.name}: {why}", highlight=False)
    llm = settings.coder.llm
    options = EvalOptions(
        run_id=run_id or new_run_id(),
        policy=policy,
        backend=backend_name,
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
        kv_cache=cache or llm.kv_cache,
        compile_baseline=compile_baseline,
    )
    console.print(
        f"evaluation {options.run_id}: {len(loaded.problems)} problems × {samples} samples",
        highlight=False,
    )
    last = EvalProgress()
    try:
        with _progress_bars(counts=True) as bars:
            gen = bars.add_task("generated", total=None, detail="")
            ver = bars.add_task("verified", total=None, detail="")

            def show(p: EvalProgress) -> None:
                nonlocal last
                last = p
                bars.update(gen, total=p.to_generate, completed=p.generated)
                bars.update(ver, total=p.to_verify, completed=p.verified,
                            detail=f"correct {p.correct}" + (f", {p.resumed} stored before"
                                                             if p.resumed else ""))

            progress = _run(run_evaluation(settings, loaded, options, on_progress=show))
    except KeyboardInterrupt:
        # Ctrl-C, or a GPU slot's `timeout -s INT`: what is stored stays, and the same
        # command with this run id goes on from there.
        err_console.print(
            f"evaluation {options.run_id} cut: {last.verified} of {last.to_verify} kernels "
            f"verified now ({last.correct} correct), {last.resumed} before, all stored; "
            f"resume with the same command and --run-id {options.run_id}",
            highlight=False)
        raise typer.Exit(130) from None
    console.print(
        f"evaluation {options.run_id}: {progress.verified} kernels verified now "
        f"({progress.correct} correct), {progress.resumed} before; "
        f"kz eval report {options.run_id}",
        highlight=False,
    )
    if progress.not_generated:
        for pid, error in progress.not_generated.items():
            err_console.print(f"{pid}: no samples: {error}", highlight=False)
        err_console.print(
            f"{len(progress.not_generated)} problems got no samples (the policy's backend "
            f"failed on them; the rest are done): resume with --run-id {options.run_id} to "
            "try them again", highlight=False)
        raise typer.Exit(1)


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
    from kz_stream.evaluation import (
        build_report,
        load_evaluation,
        throughput_line,
        write_report,
    )

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
    _print_report(f"evaluation {run_id}", report.as_dict(), report.metrics,
                  throughput_line(report.throughput))
    console.print(f"wrote {', '.join(p.name for p in paths)} to {out}", highlight=False)


def _print_report(title: str, doc: Mapping[str, Any], metrics: Mapping[str, SuiteMetrics],
                  throughput: str) -> None:
    """The summary table, the statuses and the throughput of a report."""
    from kz_stream.evaluation import table_rows

    header, rows = table_rows(metrics)
    table = Table(*header, title=f"{title} ({doc['verified']}/{doc['expected']} kernels "
                                 "verified)")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print("statuses: " + ", ".join(f"{k} {v}" for k, v in doc["statuses"].items()),
                  highlight=False)
    console.print(throughput, highlight=False)
    again = doc.get("verify_again", 0)
    if again:
        are = "verdict is" if again == 1 else "verdicts are"
        console.print(f"[yellow]{again} {are} the verifier's own failure and not "
                      "counted: run kz eval run again with the same --run-id to verify "
                      "those kernels again[/]")
    versions = doc["verifier_versions"]
    if len(versions) > 1:
        console.print(f"[yellow]verdicts of {len(versions)} verifier versions "
                      f"({', '.join(versions)}): one figure wants one version (kz rescore "
                      "judges the older verdicts' kernels again)[/]")


@eval_app.command("merge")
@_one_line_errors
def eval_merge(
    reports: Annotated[list[Path], typer.Argument(
        help="The report.json of each part (kz eval report RUN writes one).")],
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path(".kz/eval/merged"),
) -> None:
    """Merges the reports of runs that each evaluated some problems of one evaluation (an
    evaluation split over GPU slots, sessions or hosts with --match or --limit) into its
    table, report.json, report.md and plots."""
    import json

    from kz_stream.evaluation import merge_reports, throughput_line, write_merged

    merged = merge_reports([json.loads(p.read_text()) for p in reports])
    paths = write_merged(merged, out)
    _print_report(f"evaluation of {len(reports)} parts", merged.doc, merged.metrics,
                  throughput_line(merged.throughput))
    console.print(f"wrote {', '.join(p.name for p in paths)} to {out}", highlight=False)
