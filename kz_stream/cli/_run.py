"""``kz serve``, ``train``, ``run``: the services and the co-evolution loop."""

from __future__ import annotations

import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import ValidationError
from rich.table import Table

from kz_stream.cli._common import ConfigOption, _bad_option, _read_store, _run, _settings
from kz_stream.cli._output import _one_line_errors, _progress_bars, console
from kz_stream.config import Settings, validated_copy

if TYPE_CHECKING:
    from kz_stream.app import RunOptions
    from kz_stream.summary import Outcome, RunSummary

SERVICES = ("recorder", "verifier", "proposer", "coder", "learner")


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


@_one_line_errors
def run_loop(
    config: ConfigOption = None,
    rounds: Annotated[int, typer.Option(help="Alternation rounds.")] = 1,
    steps_per_turn: Annotated[int, typer.Option(help="Training steps per role per round.")] = 1,
    group_size: Annotated[int, typer.Option(help="Kernels sampled per module (G).")] = 2,
    groups_per_step: Annotated[int, typer.Option(help="Complete groups per training step.")] = 2,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(help="The Coder's completion length cap (its kernels), in tokens; "
                          "default 1280, which the warm Coder's longest answers fit."),
    ] = None,
    proposer_max_new_tokens: Annotated[
        int | None,
        typer.Option(help="The Proposer's completion length cap (its modules), in tokens; "
                          "default 640."),
    ] = None,
    temperature: Annotated[
        float | None,
        typer.Option(help="Sampling temperature of both generators (and so of the learner's "
                          "importance ratios); default: the settings' (1.0)."),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(help="Where both generators' models run (cpu, cuda, cuda:1); default: "
                          "the settings' (the CPU). The learner and verifier use a visible GPU."),
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
        temperature=temperature,
        device=device,
        time_limit_s=time_limit,
    )
    if max_new_tokens is not None:
        options = replace(options, max_new_tokens=max_new_tokens)
    if proposer_max_new_tokens is not None:
        options = replace(options, proposer_max_new_tokens=proposer_max_new_tokens)
    try:  # both generators' caps are ``max_tokens``: the Proposer's is named here
        validated_copy(settings.proposer.llm, max_tokens=options.proposer_max_new_tokens)
    except ValidationError as e:
        raise _bad_option(e, "--proposer-max-new-tokens") from None
    try:
        options.apply(settings)  # refused here, before anything starts, if impossible
    except ValidationError as e:
        raise _bad_option(e) from None
    total_steps = rounds * steps_per_turn * len(options.order)
    shown_rounds: set[int] = set()
    stop_told: list[bool] = []

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
            if report.stopping and not stop_told:
                stop_told.append(True)
                progress.console.print(
                    "schedule done: stopping (the calls the Coder and the Proposer have in "
                    "flight are given up: no step would train on them)" if report.finished
                    else "time limit reached: stopping (the Coder and the Proposer finish "
                    "the calls they have in flight and their results are stored)")
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
                       ("max_new_tokens", "--max-new-tokens"),
                       ("proposer_max_new_tokens", "--proposer-max-new-tokens"),
                       ("temperature", "--temperature"),
                       ("device", "--device"), ("time_limit_s", "--time-limit")):
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
