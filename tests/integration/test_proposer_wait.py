"""A Proposer step waits for proposal groups the Coder is scoring, but not for ever: its
turn blocks the Coder's, and new valid proposals can keep groups being scored all along."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kz_stream.events import (
    Completion,
    Event,
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    ModuleValidation,
    VerdictStatus,
    new_event,
)
from kz_stream.store import open_store
from kz_stream.testing.tiny import EOS, prompt_ids
from tests.integration.test_learner_restart import learner_env, read, wait_steps

pytestmark = pytest.mark.slow

WAIT_S = 3.0


def proposal(mid: str, gid: str, digit: int, *, valid: bool) -> Event:
    return new_event(
        ModuleProposed(
            module_id=mid, group_id=gid, api_set=["torch.relu"], source="x",
            prompt=f"<bos> {digit} =",
            completion=Completion(text="", token_ids=[digit, EOS], logprobs=[-1.0, -0.5],
                                  prompt_token_ids=prompt_ids(digit)),
            validation=ModuleValidation(valid=valid, reason=None if valid else "crash"),
        ),
        stream_id=f"module-{mid}", stream_version=0,
    )


def kernels(mid: str, verdicts: list[VerdictStatus | None]) -> list[Event]:
    """A Coder group for module ``mid``: one kernel per entry, verified where it is not
    None."""
    events = []
    for k, status in enumerate(verdicts):
        kid = f"{mid}-k{k}"
        events.append(new_event(
            KernelGenerated(kernel_id=kid, module_id=mid, group_id=f"{mid}-g",
                            group_size=len(verdicts), backend="triton", source="y"),
            stream_id=f"kernel-{kid}", stream_version=0))
        if status is not None:
            events.append(new_event(
                KernelVerified(kernel_id=kid, module_id=mid, group_id=f"{mid}-g",
                               status=status),
                stream_id=f"kernel-{kid}", stream_version=1))
    return events


def test_a_proposer_step_trains_on_the_ready_groups_once_its_wait_runs_out(
    tmp_path: Path,
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3"
    ok, bad = VerdictStatus.CORRECT, VerdictStatus.INCORRECT
    events = [
        # Rewards differ: a valid module the Coder half solves (reward 1) and an invalid one.
        proposal("a1", "informative", 1, valid=True), proposal("a2", "informative", 2,
                                                               valid=False),
        *kernels("a1", [ok, bad]),
        # Equal rewards: two invalid modules (a step on this group alone learns nothing).
        proposal("b1", "equal", 3, valid=False), proposal("b2", "equal", 4, valid=False),
        # Being scored: the Coder has written kernels for its valid module, no verdict yet.
        proposal("c1", "scoring", 5, valid=True), *kernels("c1", [None, None]),
    ]

    async def fill() -> None:
        async with open_store(url) as store:
            await store.append(events)

    asyncio.run(fill())
    env = {**learner_env(tmp_path, url, max_staleness=4),
           "KZ_LEARNER__ORDER": '["proposer"]', "KZ_LEARNER__PROPOSER_WAIT_S": str(WAIT_S)}
    log = tmp_path / "learner.log"
    with open(log, "wb") as stderr:
        learner = subprocess.Popen(
            [sys.executable, "-m", "kz_stream.cli", "train", "--role", "proposer",
             "--steps-per-turn", "1", "--rounds", "1", "--groups-per-step", "2"],
            env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        try:
            wait_steps(url, 1, learner, log)
        finally:
            learner.send_signal(signal.SIGTERM)
            assert learner.wait(timeout=60) == 0, log.read_text()[-3000:]

    (step,) = read(url, "TrainingStepCompleted")
    # Only one group's rewards differ, so the step waited for the group being scored,
    # and when the wait ran out it took the ready ones, the informative group first.
    assert step["role"] == "proposer"
    assert step["group_ids"] == ["informative", "equal"]
    assert step["waited_seconds"] >= WAIT_S
    (over,) = [json.loads(line) for line in log.read_text().splitlines()
               if '"proposer_wait_over"' in line]
    assert over["being_scored"] == 1 and over["waited_s"] >= WAIT_S
