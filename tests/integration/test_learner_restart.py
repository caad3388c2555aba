"""The learner, killed with SIGKILL mid-run and restarted, trains on every complete group
exactly once and publishes contiguous policy versions."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kz_stream.events import (
    Completion,
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    ModuleValidation,
    VerdictStatus,
    new_event,
)
from kz_stream.store import open_store
from kz_stream.testing.tiny import EOS, prompt_ids, tiny_model, tiny_tokenizer

pytestmark = pytest.mark.slow

GROUPS = 6


def fill_store(url: str, groups: range = range(GROUPS)) -> set[str]:
    """Complete coder groups of two kernels each, one correct and one not."""
    events = []
    group_ids = set()
    for g in groups:
        mid, gid = f"m{g}", uuid.uuid4().hex
        group_ids.add(gid)
        events.append(
            new_event(
                ModuleProposed(
                    module_id=mid,
                    api_set=["torch.relu"],
                    source="x",
                    validation=ModuleValidation(valid=True),
                ),
                stream_id=f"module-{mid}",
                stream_version=0,
            )
        )
        for k, correct in enumerate((True, False)):
            kid = f"{gid}-{k}"
            answer = [(g + 3) % 10 if correct else (g + 4) % 10, EOS]
            events.append(
                new_event(
                    KernelGenerated(
                        kernel_id=kid,
                        module_id=mid,
                        group_id=gid,
                        group_size=2,
                        backend="triton",
                        source="y",
                        prompt=f"<bos> {g} =",
                        policy_version=0,
                        completion=Completion(
                            text="",
                            token_ids=answer,
                            logprobs=[-1.0, -0.5],
                            prompt_token_ids=prompt_ids(g),
                        ),
                    ),
                    stream_id=f"kernel-{kid}",
                    stream_version=0,
                )
            )
            events.append(
                new_event(
                    KernelVerified(
                        kernel_id=kid,
                        module_id=mid,
                        group_id=gid,
                        status=VerdictStatus.CORRECT if correct else VerdictStatus.INCORRECT,
                        speedup=1.0,
                    ),
                    stream_id=f"kernel-{kid}",
                    stream_version=1,
                )
            )

    async def go() -> None:
        async with open_store(url) as store:
            await store.append(events)

    asyncio.run(go())
    return group_ids


def read(url: str, type_: str) -> list[dict]:  # type: ignore[type-arg]
    async def go() -> list[dict]:  # type: ignore[type-arg]
        async with open_store(url, create_schema=False) as store:
            return [r.event.payload async for b in store.read_all(0, types=[type_]) for r in b]

    return asyncio.run(go())


def start_learner(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kz_stream.cli",
            "train",
            "--role",
            "coder",
            "--steps-per-turn",
            str(GROUPS),
            "--rounds",
            "1",
            "--groups-per-step",
            "1",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),
    )


def wait_steps(url: str, n: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if len(read(url, "TrainingStepCompleted")) >= n:
            return
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} training steps after 300 s")


def test_a_learner_killed_mid_run_resumes_without_losing_or_repeating_groups(
    tmp_path: Path,
) -> None:
    model_dir = tmp_path / "tiny"
    tiny_model().save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    url = f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3"
    # Half the groups first: the first learner cannot get through all of them before the
    # kill, however fast its steps are; the rest arrive while it is down.
    group_ids = fill_store(url, range(GROUPS // 2))
    env = {
        **os.environ,
        "KZ_DATABASE_URL": url,
        "KZ_BUS_URL": "memory://",
        "KZ_LEARNER__MODEL": str(model_dir),
        "KZ_LEARNER__CHECKPOINT_DIR": str(tmp_path / "policies"),
        "KZ_LEARNER__ORDER": '["coder"]',
        "KZ_LEARNER__LEARNING_RATE": "0.01",
        "KZ_LEARNER__LORA_R": "4",
        "KZ_LEARNER__MAX_STALENESS": str(GROUPS),  # all samples are v0: keep them usable
    }
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = start_learner(env, first_log)
    try:
        wait_steps(url, 2, first, first_log)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    steps_at_kill = len(read(url, "TrainingStepCompleted"))
    assert 2 <= steps_at_kill <= GROUPS // 2
    group_ids |= fill_store(url, range(GROUPS // 2, GROUPS))

    second = start_learner(env, second_log)
    try:
        wait_steps(url, GROUPS, second, second_log)
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0, second_log.read_text()[-3000:]

    steps = read(url, "TrainingStepCompleted")
    used = [gid for s in steps for gid in s["group_ids"]]
    assert sorted(used) == sorted(group_ids)  # every group once: none lost, none repeated
    assert all(len(s["kernel_ids"]) == 2 for s in steps)
    # Each step says how long it trained and how long the learner had waited for it.
    assert all(s["train_seconds"] > 0 and s["waited_seconds"] >= 0 for s in steps)
    versions = [p["version"] for p in read(url, "PolicyVersionPublished")]
    assert versions == list(range(1, GROUPS + 1))
    assert "resumed_from" in second_log.read_text()
