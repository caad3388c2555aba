"""`kz run` for one short round on the embedded default: the full event trail exists."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from kz_stream.app import RunOptions, run_coevolution
from kz_stream.config import Settings, TopicsConfig
from kz_stream.events import TrainingStepCompleted, payload_as
from kz_stream.rl.trainer import policy_sha256
from kz_stream.store import open_store
from kz_stream.warmstart import packaged_adapter

pytestmark = pytest.mark.slow


def test_one_round_leaves_the_full_event_trail(tmp_path: Path) -> None:
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3",
        bus_url=f"memory://{uuid.uuid4().hex}",
        topics=TopicsConfig(partitions=2),
        log_level="WARNING",
    )
    options = RunOptions(
        rounds=1, steps_per_turn=1, group_size=2, groups_per_step=1,
        proposals_per_prompt=2, max_new_tokens=32, order=("coder", "proposer"),
        time_limit_s=900, checkpoint_dir=str(tmp_path / "policies"),
    )
    report = asyncio.run(run_coevolution(settings, options))
    assert report.finished, report

    async def trail() -> dict[str, list]:  # type: ignore[type-arg]
        out: dict[str, list] = {}  # type: ignore[type-arg]
        async with open_store(settings.database_url, create_schema=False) as store:
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
