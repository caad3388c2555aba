"""`kz run` for one short round on the embedded default, run as a user runs it: the full
event trail exists, the screen is free of third-party noise, and the output ends with the
run's summary, which agrees with the store."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kz_stream.events import TrainingStepCompleted, payload_as
from kz_stream.rl.trainer import policy_sha256
from kz_stream.store import open_store
from kz_stream.summary import RunSummary, load_run_summary
from kz_stream.warmstart import packaged_adapter

pytestmark = pytest.mark.slow


def test_one_round_leaves_the_full_event_trail_and_ends_with_its_summary(
    tmp_path: Path,
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3"
    env = {**os.environ, "COLUMNS": "200", "KZ_DATABASE_URL": url,
           "KZ_BUS_URL": f"memory://{uuid.uuid4().hex}", "KZ_TOPICS__PARTITIONS": "2"}
    env.pop("KZ_LOG_LEVEL", None)  # the default screen
    # Checkpoints go to .kz/policies under the working directory.
    run = subprocess.run(
        [sys.executable, "-m", "kz_stream.cli", "run", "--groups-per-step", "1",
         "--max-new-tokens", "32", "--proposer-max-new-tokens", "32",
         "--time-limit", "900"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1500,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    for noise in ("Loading weights", "Disabling Triton", "TRL currently supports vLLM",
                  "nanobind"):
        assert noise not in run.stderr, run.stderr

    async def trail() -> dict[str, list]:  # type: ignore[type-arg]
        out: dict[str, list] = {}  # type: ignore[type-arg]
        async with open_store(url, create_schema=False) as store:
            async for batch in store.read_all(0):
                for r in batch:
                    out.setdefault(r.event.type, []).append(r.event)
        return out

    events = asyncio.run(trail())
    for t in ("ModuleProposed", "KernelGenerated", "KernelVerified", "FrontierUpdated",
              "TrainingStepCompleted", "PolicyVersionPublished", "PolicyVersionLoaded"):
        assert events.get(t), f"no {t} in the store"
    steps = [payload_as(e, TrainingStepCompleted) for e in events["TrainingStepCompleted"]]
    coder_steps = [s for s in steps if s.role == "coder"]
    assert coder_steps and coder_steps[0].kernel_ids, coder_steps
    kernel_ids = {e.payload["kernel_id"] for e in events["KernelGenerated"]}
    assert set(coder_steps[0].kernel_ids) <= kernel_ids
    verified = {e.payload["kernel_id"] for e in events["KernelVerified"]}
    assert set(coder_steps[0].kernel_ids) <= verified
    published = [e.payload for e in events["PolicyVersionPublished"]]
    loaded = [e.payload for e in events["PolicyVersionLoaded"]]
    assert any(p["role"] == "coder" and p["version"] >= 1 for p in published)
    assert any(p["role"] == "coder" and p["version"] >= 1 for p in loaded)
    assert all(Path(p["uri"].removeprefix("file://")).is_dir() for p in published)
    # The warm start: version 0 of each role is the packaged adapter, and says so.
    for role in ("coder", "proposer"):
        [zero] = [p for p in published if p["role"] == role and p["version"] == 0]
        adapter = packaged_adapter(role)
        assert adapter is not None and zero["uri"] == adapter.resolve().as_uri()
        assert zero["sha256"] == policy_sha256(adapter)

    # The summary, replayed from the store, agrees with the trail, and the output ends with
    # it: headline, figures, and next commands naming a real kernel and the new Coder.
    async def summary() -> RunSummary:
        async with open_store(url, create_schema=False) as store:
            return await load_run_summary(store, "run-0", outcome="finished")

    s = asyncio.run(summary())
    assert s.kernels == len(kernel_ids) and s.coder.steps == s.proposer.steps == 1
    assert sum(s.verdicts.values()) + s.unverified == s.kernels
    assert s.coder.warm_start_packaged and s.proposer.warm_start_packaged
    assert s.audit_kernel and s.audit_kernel.removeprefix("kernel-") in kernel_ids
    out = run.stdout
    tail = out[out.index("run run-0 finished in"):]
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    assert len(lines) <= 12, tail
    assert "rounds 1 of 1; steps coder 1/1, proposer 1/1" in tail
    assert f"{s.kernels} generated: " in tail
    assert "coder v0 (packaged warm start) -> v1" in tail
    assert f"kz audit {s.audit_kernel}" in tail
    assert lines[-1].startswith(f"kz eval run SUITE --policy run:run-0:{s.coder.latest}"), tail
