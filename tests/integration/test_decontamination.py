"""The Proposer rejects modules that copy an evaluation problem, with their own reason:
problems of a suite given to it, and problems some `kz eval run` stored."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from kz_stream.app import evaluation_hashes, open_context
from kz_stream.config import ProposerSettings, Settings, TopicsConfig
from kz_stream.consumers.recorder import Recorder
from kz_stream.events import ModuleProposed, ModuleValidation, new_event, payload_as
from kz_stream.llm import create_backend
from kz_stream.modules import normalized_hash
from kz_stream.producers.proposer import ProposerService
from kz_stream.producers.seeds import SEED_MODULES

pytestmark = pytest.mark.slow


async def test_proposals_copying_evaluation_problems_are_contaminated(tmp_path: Path) -> None:
    given, evaluated, new = SEED_MODULES[:3]
    suite = tmp_path / "level1"
    suite.mkdir()
    # The same module with a comment added: the normalized hash still matches.
    (suite / "1_Given.py").write_text("# a KernelBench problem\n" + given.source)
    settings = Settings(database_url=f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3",
                        bus_url=f"memory://{uuid.uuid4().hex}",
                        topics=TopicsConfig(partitions=2), log_level="WARNING")
    async with open_context(settings) as ctx:
        # An earlier evaluation stored this problem (as kz eval run does).
        await ctx.store.append([new_event(
            ModuleProposed(module_id="kb-1", api_set=[], source=evaluated.source,
                           normalized_hash=normalized_hash(evaluated.source),
                           validation=ModuleValidation(
                               valid=True, detail="evaluation problem level2/7_Evaluated")),
            stream_id="module-kb-1", stream_version=0, correlation_id="eval-earlier")])
        proposer = ProposerService(
            ctx, create_backend("transformers"),
            ProposerSettings(max_modules=3, concurrency=1, synthesized_fallback=False),
            seed_modules=(given, evaluated, new), evaluation_hashes=evaluation_hashes([suite]))
        recorder = Recorder(ctx)
        tasks = [asyncio.create_task(s.run()) for s in (recorder, proposer)]
        try:
            await asyncio.wait_for(tasks[1], timeout=300)  # it stops after three modules
            for _ in range(300):
                stored = [payload_as(r.event, ModuleProposed)
                          async for b in ctx.store.read_all(0, types=["ModuleProposed"])
                          for r in b if r.event.correlation_id == settings.run_id]
                if len(stored) == 3:
                    break
                await asyncio.sleep(0.1)
        finally:
            recorder.request_stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            await proposer.backend.close()
    by_source = {m.source: m.validation for m in stored}
    assert by_source[given.source].reason == "contaminated"
    assert "evaluation problem level1/1_Given" in (by_source[given.source].detail or "")
    assert by_source[evaluated.source].reason == "contaminated"
    assert "level2/7_Evaluated" in (by_source[evaluated.source].detail or "")
    assert by_source[new.source].reason != "contaminated"
    assert not by_source[given.source].valid and not by_source[evaluated.source].valid
