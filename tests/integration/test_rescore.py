"""`kz rescore` with the real verifier (CPU path) and a SQLite store: kernels judged by an
older verifier version get a verdict of the current one beside the old, the drift names
the flips by check and the training step that used a flipped verdict, and a second run
has nothing left to do."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kz_stream.cli import app
from kz_stream.events import (
    Event,
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    ModuleValidation,
    TrainingStepCompleted,
    VerdictStatus,
    new_event,
)
from kz_stream.modules import CODER_EXAMPLE_MODULE, CODER_EXAMPLES
from kz_stream.store import open_store
from kz_stream.verify import VERIFIER_VERSION

pytestmark = pytest.mark.slow

# kernel id -> (source, old status, old verifier version)
KERNELS = {
    "honest": (CODER_EXAMPLES["triton"], "incorrect", "kzv-0.9"),  # wrongly failed before
    "broken": ("class ModelNew(:\n", "correct", "kzv-0.9"),  # wrongly passed before
    "current": ("class ModelNew(:\n", "compile_error", VERIFIER_VERSION),  # judged already
}


def history() -> list[Event]:
    events = [new_event(ModuleProposed(module_id="m", api_set=["torch.relu"],
                                       source=CODER_EXAMPLE_MODULE,
                                       validation=ModuleValidation(valid=True)),
                        stream_id="module-m", stream_version=0, correlation_id="run-0")]
    for kid, (source, status, version) in KERNELS.items():
        events.append(new_event(
            KernelGenerated(kernel_id=kid, module_id="m", group_id="g", backend="triton",
                            source=source, policy_version=1),
            stream_id=f"kernel-{kid}", stream_version=0, correlation_id="run-0"))
        events.append(new_event(
            KernelVerified(kernel_id=kid, module_id="m", group_id="g",
                           status=VerdictStatus(status), verifier_version=version),
            stream_id=f"kernel-{kid}", stream_version=1, correlation_id="run-0"))
    events.append(new_event(
        TrainingStepCompleted(role="coder", step=3, policy_version=2,
                              kernel_ids=["broken", "current"]),
        stream_id="learner-coder", stream_version=0, correlation_id="run-0"))
    return events


def test_rescore_writes_new_verdicts_and_reports_the_drift(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3"

    async def seed() -> None:
        async with open_store(url) as store:
            await store.append(history())

    asyncio.run(seed())
    env = {"KZ_DATABASE_URL": url, "KZ_VERIFIER__DEVICES": "[]", "COLUMNS": "200"}
    out = tmp_path / "drift.json"
    result = CliRunner().invoke(app, ["rescore", "--out", str(out)], env=env)
    assert result.exit_code == 0, result.output
    assert "2 of 3 kernels to verify" in result.stdout
    drift = json.loads(out.read_text())
    assert drift["rescored"] == 2 and drift["compared"] == 2 and drift["flipped"] == 2
    flips = {(f["from"], f["to"], f["check"]) for f in drift["flips"]}
    assert flips == {("incorrect", "correct", "-"), ("correct", "compile_error", "python_syntax")}
    assert drift["training_steps"] == [
        {"role": "coder", "step": 3, "policy_version": 2, "flipped_kernels": ["broken"]}]

    async def verdicts() -> dict[str, list[tuple[str, str]]]:
        async with open_store(url) as store:
            found: dict[str, list[tuple[str, str]]] = {}
            async for b in store.read_all(0, types=["KernelVerified"]):
                for r in b:
                    p = r.event.payload
                    found.setdefault(p["kernel_id"], []).append(
                        (p["verifier_version"], p["status"]))
            return found

    stored = asyncio.run(verdicts())
    # The old verdicts stay; the new ones sit beside them.
    assert stored["honest"] == [("kzv-0.9", "incorrect"), (VERIFIER_VERSION, "correct")]
    assert stored["broken"] == [("kzv-0.9", "correct"), (VERIFIER_VERSION, "compile_error")]
    assert stored["current"] == [(VERIFIER_VERSION, "compile_error")]

    again = CliRunner().invoke(app, ["rescore"], env=env)
    assert again.exit_code == 0, again.output
    assert "0 of 3 kernels to verify" in again.stdout
