"""The Proposer rejects modules that copy an evaluation problem, with their own reasons:
problems of a suite given to it, and problems some `kz eval run` stored. A copy with the
problem's normalized hash is `contaminated`; one in other code with the problem's API set
on inputs of the same shapes is `contaminated_apis`; the same APIs at other shapes pass."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest

from kz_stream.app import evaluation_problems, open_context
from kz_stream.config import ProposerSettings, Settings, TopicsConfig
from kz_stream.consumers.recorder import Recorder
from kz_stream.events import ModuleProposed, ModuleValidation, new_event, payload_as
from kz_stream.llm import create_backend
from kz_stream.modules import normalized_hash
from kz_stream.producers.proposer import ProposerService, SeedModule
from kz_stream.producers.seeds import SEED_MODULES

pytestmark = pytest.mark.slow


async def propose(
    tmp_path: Path, suite: Path, stored_problem: tuple[str, str], seeds: Sequence[SeedModule]
) -> dict[str, ModuleValidation]:
    """Runs a Proposer that publishes ``seeds`` against ``suite`` and a store holding
    ``stored_problem`` (source, id) as an earlier evaluation run stored it; returns the
    validation of each seed's source."""
    settings = Settings(database_url=f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3",
                        bus_url=f"memory://{uuid.uuid4().hex}",
                        topics=TopicsConfig(partitions=2), log_level="WARNING")
    source, problem_id = stored_problem
    async with open_context(settings) as ctx:
        await ctx.store.append([new_event(
            ModuleProposed(module_id="kb-1", api_set=[], source=source,
                           normalized_hash=normalized_hash(source),
                           validation=ModuleValidation(
                               valid=True, detail=f"evaluation problem {problem_id}")),
            stream_id="module-kb-1", stream_version=0, correlation_id="eval-earlier")])
        proposer = ProposerService(
            ctx, create_backend("transformers"),
            ProposerSettings(max_modules=len(seeds), concurrency=1, synthesized_fallback=False),
            seed_modules=seeds, evaluation_problems=evaluation_problems([suite]))
        recorder = Recorder(ctx)
        tasks = [asyncio.create_task(s.run()) for s in (recorder, proposer)]
        try:
            await asyncio.wait_for(tasks[1], timeout=300)  # it stops after the seeds
            for _ in range(300):
                stored = [payload_as(r.event, ModuleProposed)
                          async for b in ctx.store.read_all(0, types=["ModuleProposed"])
                          for r in b if r.event.correlation_id == settings.run_id]
                if len(stored) == len(seeds):
                    break
                await asyncio.sleep(0.1)
        finally:
            recorder.request_stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            await proposer.backend.close()
    return {m.source: m.validation for m in stored}


async def test_proposals_copying_evaluation_problems_are_contaminated(tmp_path: Path) -> None:
    given, evaluated, new = SEED_MODULES[:3]
    suite = tmp_path / "level1"
    suite.mkdir()
    # The same module with a comment added: the normalized hash still matches.
    (suite / "1_Given.py").write_text("# a KernelBench problem\n" + given.source)
    by_source = await propose(tmp_path, suite, (evaluated.source, "level2/7_Evaluated"),
                              (given, evaluated, new))
    assert by_source[given.source].reason == "contaminated"
    assert "evaluation problem level1/1_Given" in (by_source[given.source].detail or "")
    assert by_source[evaluated.source].reason == "contaminated"
    assert "level2/7_Evaluated" in (by_source[evaluated.source].detail or "")
    assert by_source[new.source].reason not in ("contaminated", "contaminated_apis")
    assert not by_source[given.source].valid and not by_source[evaluated.source].valid


def kernelbench_problem(model: str, inputs: str, init_inputs: str) -> str:
    return (f"import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n\n{model}"
            f"\n\ndef get_inputs():\n    return {inputs}\n\n\n"
            f"def get_init_inputs():\n    return {init_inputs}\n")


GEMM_SIGMOID = kernelbench_problem('''\
class Model(nn.Module):
    """Gemm, then sigmoid, then scaling."""

    def __init__(self, in_features, out_features, scale):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.scale = scale

    def forward(self, x):
        return torch.sigmoid(self.gemm(x)) * self.scale
''', "[torch.randn(16, 64)]", "[64, 32, 2.0]")
GEMM_SIGMOID_APIS = ("torch.nn.Linear", "torch.sigmoid")

NORM_TANH = kernelbench_problem('''\
class Model(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.norm = nn.LayerNorm(features)

    def forward(self, x):
        return torch.tanh(self.norm(x))
''', "[torch.randn(8, 24, 32)]", "[32]")
NORM_TANH_APIS = ("torch.nn.LayerNorm", "torch.tanh")


def rewritten_gemm_sigmoid(batch: int) -> str:
    """GEMM_SIGMOID renamed and re-parametrised (other widths, no bias, no scale)."""
    return kernelbench_problem('''\
class Model(nn.Module):
    def __init__(self, d_in, d_hidden):
        super().__init__()
        self.proj = nn.Linear(d_in, d_hidden, bias=False)

    def forward(self, inp):
        hidden = self.proj(inp)
        return F.sigmoid(hidden) + 1.0
''', f"[torch.randn({batch}, 64)]", "[64, 48]")


async def test_copies_with_an_evaluation_problems_apis_and_shapes_are_contaminated(
    tmp_path: Path,
) -> None:
    suite = tmp_path / "level2"
    suite.mkdir()
    (suite / "12_Gemm_Sigmoid.py").write_text(GEMM_SIGMOID)
    copy_of_suite_problem = rewritten_gemm_sigmoid(batch=16)
    other_shapes = rewritten_gemm_sigmoid(batch=8)
    copy_of_stored_problem = kernelbench_problem('''\
class Model(nn.Module):
    def __init__(self, width, epsilon):
        super().__init__()
        self.ln = nn.LayerNorm(width, eps=epsilon)

    def forward(self, activations):
        return self.ln(activations).tanh()
''', "[torch.randn(8, 24, 32)]", "[32, 1e-3]")
    hash_copy = "# the same problem, commented\n" + GEMM_SIGMOID
    seeds = (
        SeedModule(GEMM_SIGMOID_APIS, copy_of_suite_problem),
        SeedModule(NORM_TANH_APIS, copy_of_stored_problem),
        SeedModule(GEMM_SIGMOID_APIS, other_shapes),
        SeedModule(GEMM_SIGMOID_APIS, hash_copy),
    )
    by_source = await propose(tmp_path, suite, (NORM_TANH, "level1/40_LayerNorm_Tanh"), seeds)

    copied = by_source[copy_of_suite_problem]
    assert (copied.valid, copied.reason) == (False, "contaminated_apis")
    assert copied.detail == ("APIs {torch.nn.Linear, torch.sigmoid} on inputs float32[16, 64], "
                             "as evaluation problem level2/12_Gemm_Sigmoid")
    assert set(copied.apis_called) >= set(GEMM_SIGMOID_APIS)  # validation's, kept
    stored = by_source[copy_of_stored_problem]
    assert (stored.valid, stored.reason) == (False, "contaminated_apis")
    assert "as evaluation problem level1/40_LayerNorm_Tanh" in (stored.detail or "")
    # The Proposer is meant to recombine APIs: the same ones at other shapes are new.
    assert by_source[other_shapes].valid, by_source[other_shapes]
    # A copy of the code itself is still caught by its hash, before it is run.
    assert by_source[hash_copy].reason == "contaminated"
