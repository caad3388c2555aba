"""``kz warmstart``: teacher-distilled SFT data and adapters for a warm start."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from kz_stream.cli._common import ConfigOption, _read_store, _run, _settings
from kz_stream.cli._output import _one_line_errors, _progress_bars, console
from kz_stream.config import PROPOSER_TEMPERATURE

warmstart_app = typer.Typer(help="Teacher-distilled SFT data and adapters for a warm start.")


def _validated_suite(out: Path, *, count: int, **options: Any) -> Any:
    """``synthesize_suite`` under a progress bar; returns its ``SuiteSummary``."""
    from kz_stream.warmstart.data import synthesize_suite

    with _progress_bars(counts=True) as bars:
        task = bars.add_task("modules validated", total=count, detail="")
        summary = synthesize_suite(
            out, count=count, on_module=lambda done, total: bars.update(task, completed=done),
            **options)
        bars.update(task, completed=count,
                    detail=f"{summary.valid} valid ({summary.train} train, "
                           f"{summary.held_out} held out)")
    return summary


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
    from kz_stream.warmstart.data import teacher_run_id, write_sft_sets

    settings = _settings(config, quiet=True)
    started = time.monotonic()
    summary = _validated_suite(out, count=count, seed=seed, held_out=held_out,
                               workers=workers)
    console.print(
        f"modules: {summary.valid}/{summary.modules} valid"
        + (f"; invalid: {summary.invalid_reasons}" if summary.invalid_reasons else ""),
        highlight=False)
    run_id = teacher_run_id(out)
    # The SFT set needs the teacher's verdicts and eager speedups; timing each reference
    # under torch.compile too would spend a compile per module on a GPU for nothing.
    options = EvalOptions(run_id=run_id, policy="teacher", samples=1, concurrency=concurrency,
                          sampling=SamplingParams(max_tokens=1, temperature=0.0),
                          compile_baseline=False)
    with _progress_bars(counts=True) as bars:
        ver = bars.add_task("teacher kernels verified", total=None, detail="")

        def show(p: EvalProgress) -> None:
            bars.update(ver, total=p.to_verify, completed=p.verified,
                        detail=f"correct {p.correct}")

        _run(run_evaluation(settings, load_suite(out / "train"), options, on_progress=show))

    sets = _read_store(settings, lambda store: write_sft_sets(out, store))
    console.print(sets.describe(), style="yellow" if sets.unjudged else None, highlight=False)
    console.print(
        f"teacher run {run_id}: {sets.coder} Coder examples, {sets.proposer} Proposer "
        f"examples in {out} ({time.monotonic() - started:.0f} s); next: "
        f"kz warmstart train {out}/coder_sft.jsonl --out ADAPTER; "
        f"kz eval report {run_id}",
        highlight=False)


@warmstart_app.command("proposer-data")
@_one_line_errors
def warmstart_proposer_data(
    out: Annotated[Path, typer.Argument(help="Data folder (the same as `data`'s; resumable).")],
    count: Annotated[int, typer.Option(min=1, help="Modules to synthesize.")] = 1200,
    seed: Annotated[int, typer.Option(help="Synthesizer seed.")] = 0,
    workers: Annotated[int, typer.Option(min=1, help="Modules validated at once.")] = 2,
) -> None:
    """Synthesizes modules for the Proposer alone, over every API the synthesizer knows
    (image and sequence layers, losses, indexing: the sets the Proposer is asked for beyond
    what the teacher lowers), validates them as proposals, and rewrites proposer_sft.jsonl
    from both suites."""
    from kz_stream.warmstart.data import write_proposer_sft

    started = time.monotonic()
    summary = _validated_suite(out, count=count, seed=seed, workers=workers, teachable=False)
    rows = write_proposer_sft(out)
    console.print(
        f"Proposer modules: {summary.valid}/{summary.modules} valid"
        + (f"; invalid: {summary.invalid_reasons}" if summary.invalid_reasons else "")
        + f"; {rows} Proposer examples in {out}/proposer_sft.jsonl "
        f"({time.monotonic() - started:.0f} s); next: kz warmstart train "
        f"{out}/proposer_sft.jsonl --role proposer --out ADAPTER",
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
    temperature: Annotated[
        float, typer.Option(min=0.0, help="Temperature (default: the Proposer's).")
    ] = PROPOSER_TEMPERATURE,
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
    result = {"policy": policy, "temperature": temperature, "seed": seed, **score.as_dict()}
    console.print(
        f"Proposer {policy}: {score.valid}/{score.sets} valid ({score.valid_rate:.1%}); on the "
        f"synthesizer's sets {score.buildable_valid}/{score.buildable_sets}; reasons "
        f"{dict(score.reasons.most_common())}", highlight=False)
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2) + "\n")
