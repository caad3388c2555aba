"""`kz eval run` + `kz eval report` on the CPU: the embedded SmolLM2, the real verifier
(Triton interpreter path) and a SQLite store, on three small KernelBench-format problems
written here. The first run is cut short after its first verdict; the second resumes it
without sampling or verifying a stored pair again, except one whose verdict was the
verifier's own failure (``infra_error``), which it verifies again."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kz_stream.cli import app
from kz_stream.config import Settings, TopicsConfig
from kz_stream.consumers.verifier import verdict_event_id
from kz_stream.evaluation import EvalOptions, EvalProgress, kernel_id_of, load_suite, run_evaluation
from kz_stream.events import KernelGenerated, KernelVerified, new_event, payload_as
from kz_stream.llm import SamplingParams
from kz_stream.run_state import RunState
from kz_stream.store import open_store
from kz_stream.verify import Status, Verdict, VerifierConfig

pytestmark = pytest.mark.slow

PROBLEMS = {
    "1_ReluScale.py": ("x", "torch.relu(x) * 2.0", "[torch.randn(8, 64)]"),
    "2_AddMul.py": ("x, y", "(x + y) * y", "[torch.randn(16, 32), torch.randn(16, 32)]"),
    "3_Tanh.py": ("x", "torch.tanh(x) + x", "[torch.randn(4, 128)]"),
}

TEMPLATE = """\
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, {args}):
        return {body}


def get_inputs():
    return {inputs}


def get_init_inputs():
    return []
"""

RUN = "eval-e2e"
SAMPLES = 2
TOKENS = 16


class CutShort(Exception):
    pass


def write_suite(root: Path) -> Path:
    level = root / "level1"
    level.mkdir(parents=True)
    for name, (args, body, inputs) in PROBLEMS.items():
        (level / name).write_text(TEMPLATE.format(args=args, body=body, inputs=inputs))
    return level


async def stored(url: str) -> list[Any]:
    async with open_store(url, create_schema=False) as store:
        return [r for b in [b async for b in store.read_all(0)] for r in b]


async def store_infra_failure(url: str, kernel: Any) -> Any:
    """Stores the verdict a verifier gives when the device was full of others' memory."""
    failed = Verdict(Status.INFRA_ERROR, "the device had no room", check="device_memory")
    event = new_event(
        KernelVerified.from_verdict(failed, payload_as(kernel, KernelGenerated)),
        event_id=verdict_event_id(kernel.event_id), stream_id=kernel.stream_id,
        stream_version=kernel.stream_version + 1, correlation_id=RUN,
    )
    async with open_store(url, create_schema=False) as store:
        await store.append([event])
    return event


def test_eval_run_resume_and_report(tmp_path: Path) -> None:
    suite_dir = write_suite(tmp_path / "KernelBench")
    url = f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3"
    # No verifier worker started ahead of need: SmolLM2's 16-token kernels fail before
    # a worker is needed, and starting one costs tens of seconds on two busy cores.
    settings = Settings(database_url=url, bus_url=f"memory://{uuid.uuid4().hex}",
                        topics=TopicsConfig(partitions=2), log_level="WARNING",
                        verifier=VerifierConfig(prewarm=0))
    options = EvalOptions(run_id=RUN, samples=SAMPLES, concurrency=2,
                          sampling=SamplingParams(max_tokens=TOKENS, seed=0))

    def stop_after_first_verdict(p: EvalProgress) -> None:
        if p.verified >= 1:
            raise CutShort

    with pytest.raises(CutShort):
        asyncio.run(run_evaluation(settings, load_suite(suite_dir), options,
                                   on_progress=stop_after_first_verdict))
    first = asyncio.run(stored(url))
    first_verdicts = {r.event.event_id for r in first if r.event.type == "KernelVerified"}
    assert first_verdicts and len(first_verdicts) < len(PROBLEMS) * SAMPLES
    judged = {r.event.payload["kernel_id"] for r in first if r.event.type == "KernelVerified"}
    [unjudged, *_] = [r.event for r in first if r.event.type == "KernelGenerated"
                      and r.event.payload["kernel_id"] not in judged]
    infra = asyncio.run(store_infra_failure(url, unjudged))

    # The CLI in this process (CliRunner): a second interpreter would import torch again.
    cli = CliRunner()
    env = {"KZ_DATABASE_URL": url, "KZ_VERIFIER__PREWARM": "0", "COLUMNS": "200"}
    resumed = cli.invoke(app, [
        "eval", "run", str(suite_dir), "--run-id", RUN, "--samples", str(SAMPLES),
        "--max-new-tokens", str(TOKENS), "--seed", "0", "--temperature", "1.0",
        "--concurrency", "2"], env=env)
    assert resumed.exit_code == 0, resumed.output[-3000:]
    assert f"{len(first_verdicts)} before" in resumed.stdout, resumed.output

    # The run times against torch.compile (the default); it resumes only with that.
    other = cli.invoke(app, [
        "eval", "run", str(suite_dir), "--run-id", RUN, "--samples", str(SAMPLES),
        "--max-new-tokens", str(TOKENS), "--seed", "0", "--temperature", "1.0",
        "--no-compile-baseline"], env=env)
    assert other.exit_code != 0 and "compile_baseline=True" in other.output, other.output

    records = asyncio.run(stored(url))
    kinds = [r.event.type for r in records]
    pairs = len(PROBLEMS) * SAMPLES
    assert kinds.count("EvaluationStarted") == 1 and kinds.count("ModuleProposed") == 3
    # Every pair sampled once and judged once, across the cut: nothing stored twice.
    kernels = [r.event for r in records if r.event.type == "KernelGenerated"]
    verdicts = [r.event for r in records if r.event.type == "KernelVerified"]
    # ... but the one the verifier itself failed on: a second verdict, beside the first.
    assert len(kernels) == pairs and len(verdicts) == pairs + 1
    [again] = [e for e in verdicts if e.causation_id == unjudged.event_id
               and e.event_id != infra.event_id]
    assert again.stream_version == infra.stream_version + 1
    assert again.event_id == verdict_event_id(unjudged.event_id, attempt=1)
    assert again.payload["status"] != "infra_error"
    expected = {kernel_id_of(RUN, f"level1/{n[:-3]}", i) for n in PROBLEMS for i in range(SAMPLES)}
    assert {e.payload["kernel_id"] for e in kernels} == expected
    assert {e.payload["kernel_id"] for e in verdicts} == expected
    assert first_verdicts <= {e.event_id for e in verdicts}
    for e in kernels:
        assert e.correlation_id == RUN and e.payload["backend"] == "triton"
        assert "ModelNew" in json.loads(e.payload["prompt"])[0]["content"]  # the Coder prompt
        assert len(e.payload["completion"]["token_ids"]) <= TOKENS
    # The verifier's own verdicts, and the evaluation never reaches training state.
    assert all(e.payload["verifier_version"] for e in verdicts)
    state = RunState()
    state.apply_all(records)
    assert not state.kernels and not state.modules

    out = tmp_path / "report"
    report = cli.invoke(app, ["eval", "report", RUN, "--out", str(out)], env=env)
    assert report.exit_code == 0, report.output[-3000:]
    assert "pass@1" in report.stdout and f"{pairs}/{pairs} kernels verified" in report.stdout
    doc = json.loads((out / "report.json").read_text())
    assert doc["complete"] and doc["verified"] == pairs
    assert doc["throughput"]["kernels"] == pairs and doc["throughput"]["generation_minutes"] > 0
    correct = sum(e.payload["status"] == "correct" for e in verdicts)
    assert doc["metrics"]["overall"]["correct"] == correct
    assert doc["metrics"]["overall"]["pass@1"] == pytest.approx(correct / pairs)
    assert doc["metrics"]["overall"]["pass@5"] is None  # two samples cannot estimate it
    assert [p["problem_id"] for p in doc["problems"]] == [f"level1/{n[:-3]}" for n in PROBLEMS]
    assert sum(doc["statuses"].values()) == pairs and "infra_error" not in doc["statuses"]
    assert "| overall |" in (out / "report.md").read_text()
    for plot in ("pass_at_k.png", "speedups.png", "problems.png"):
        assert (out / plot).read_bytes()[:4] == b"\x89PNG"


def test_an_interrupted_eval_run_says_how_far_it_got_and_how_to_resume(tmp_path: Path) -> None:
    """Ctrl-C (or a GPU slot's ``timeout -s INT``) after the first kernel is stored: exit
    130, one line with the counts and the run id to resume with, and what was stored kept
    (the resume itself: ``test_eval_run_resume_and_report``)."""
    suite_dir = write_suite(tmp_path / "KernelBench")
    url = f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3"
    env = {"KZ_DATABASE_URL": url, "KZ_VERIFIER__PREWARM": "0", "COLUMNS": "200"}
    run = "eval-cut"
    main = threading.main_thread().ident
    assert main is not None and threading.current_thread().ident == main
    done, sent = threading.Event(), threading.Event()

    def interrupt_after_first_kernel() -> None:
        # The store is the only outside view of the run's progress: poll it, then press
        # Ctrl-C in the thread that runs the command.
        while not done.wait(0.2):
            try:
                events = asyncio.run(stored(url))
            except Exception:  # not created yet, or being written
                continue
            if any(r.event.type == "KernelGenerated" for r in events) and not done.is_set():
                sent.set()
                signal.pthread_kill(main, signal.SIGINT)
                return

    # As in a shell's foreground: a command started in the background (``cmd &``, as CI
    # may run the tests) inherits SIGINT ignored, and Ctrl-C could not reach it at all.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    poller = threading.Thread(target=interrupt_after_first_kernel, daemon=True)
    poller.start()
    try:
        cut = CliRunner().invoke(app, [
            "eval", "run", str(suite_dir), "--run-id", run, "--samples", str(SAMPLES),
            "--max-new-tokens", str(TOKENS), "--seed", "0", "--concurrency", "1",
            # One problem's samples a generation call: two more calls after the first
            # kernel is stored, time for the interrupt to land in the middle of the run.
            "--batch-size", str(SAMPLES)], env=env)
    finally:
        done.set()
        poller.join(30)
        signal.signal(signal.SIGINT, before)
    assert sent.is_set(), cut.output[-3000:]
    assert cut.exit_code == 130, cut.output[-3000:]
    assert f"evaluation {run} cut: " in cut.output, cut.output[-3000:]
    assert f"--run-id {run}" in cut.output and "all stored" in cut.output
    records = asyncio.run(stored(url))
    kernels = [r for r in records if r.event.type == "KernelGenerated"]
    verdicts = [r for r in records if r.event.type == "KernelVerified"]
    assert kernels and len(verdicts) < len(PROBLEMS) * SAMPLES


def test_problems_the_policys_backend_fails_on_are_named_and_left_to_a_resume(
    tmp_path: Path,
) -> None:
    """An endpoint that refuses a problem (here: nothing listens) does not stop the run:
    every problem is tried, none is stored half, and the command says what to resume.
    A resume of the run on the same files under other problem ids is refused."""
    import shutil

    suite_dir = write_suite(tmp_path / "KernelBench")
    url = f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3"
    env = {"KZ_DATABASE_URL": url, "KZ_VERIFIER__PREWARM": "0", "COLUMNS": "200"}
    cli = CliRunner()
    args = ["--run-id", RUN, "--samples", str(SAMPLES), "--policy", "http://127.0.0.1:9/",
            "--max-new-tokens", str(TOKENS)]
    failed = cli.invoke(app, ["eval", "run", str(suite_dir), *args], env=env)
    assert failed.exit_code == 1, failed.output[-3000:]
    said = " ".join(failed.stderr.split())
    for name in PROBLEMS:
        assert f"level1/{name[:-3]}: no samples: /v1/" in said
    assert "3 problems got no samples" in said and f"resume with --run-id {RUN}" in said
    kinds = [r.event.type for r in asyncio.run(stored(url))]
    assert "KernelGenerated" not in kinds and kinds.count("EvaluationStarted") == 1

    renamed = tmp_path / "mine"  # no level in its name: the ids are 1_ReluScale, ...
    shutil.copytree(suite_dir, renamed)
    other = cli.invoke(app, ["eval", "run", str(renamed), *args], env=env)
    assert other.exit_code != 0 and "exists with other problems" in other.output, other.output
