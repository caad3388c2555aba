"""The Proposer's valid-module rate: sample API sets, ask the policy for a module each, and
validate every reply as the Proposer service does (``validate_module``: the APIs called,
a sandboxed run, admission)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from kz_stream.llm import LLMBackend, SamplingParams
from kz_stream.modules import ApiSetSampler, extract_code, proposer_messages, validate_module
from kz_stream.warmstart.synth import synth_catalog

__all__ = ["ProposerReply", "ProposerScore", "score_proposer"]


@dataclass(frozen=True)
class ProposerReply:
    """One sampled API set and what validation said of the module written for it."""

    api_set: list[str]
    valid: bool
    reason: str  # "valid" or ModuleValidation's reason
    detail: str  # the validator's detail, cut to its last 300 characters
    buildable: bool  # the Proposer synthesizer can build this set (its SFT data covers it)


@dataclass
class ProposerScore:
    """Valid replies over all replies, overall and on the sets the synthesizer can build
    (with the Proposer-only ops: the sets the Proposer's SFT data covers)."""

    replies: list[ProposerReply] = field(default_factory=list)  # in draw order

    @property
    def sets(self) -> int:
        return len(self.replies)

    @property
    def valid(self) -> int:
        return sum(r.valid for r in self.replies)

    @property
    def buildable_sets(self) -> int:
        return sum(r.buildable for r in self.replies)

    @property
    def buildable_valid(self) -> int:
        return sum(r.valid and r.buildable for r in self.replies)

    @property
    def reasons(self) -> Counter[str]:
        return Counter(r.reason for r in self.replies)

    @property
    def valid_rate(self) -> float:
        return self.valid / self.sets if self.sets else 0.0

    @property
    def buildable_valid_rate(self) -> float:
        return self.buildable_valid / self.buildable_sets if self.buildable_sets else 0.0

    def as_dict(self) -> dict[str, object]:
        """The score as ``kz warmstart proposer-eval --json`` writes it."""
        return {"sets": self.sets, "valid": self.valid,
                "valid_rate": round(self.valid_rate, 4),
                "buildable_sets": self.buildable_sets, "buildable_valid": self.buildable_valid,
                "buildable_valid_rate": round(self.buildable_valid_rate, 4),
                "reasons": dict(self.reasons.most_common()),
                "records": [asdict(r) for r in self.replies]}


async def score_proposer(
    backend: LLMBackend,
    *,
    sets: int,
    seed: int = 0,
    sampling: SamplingParams,
    workers: int = 2,
    on_progress: Callable[[int, int], object] | None = None,
) -> ProposerScore:
    """Draws ``sets`` API sets with the Proposer's sampler (seeded), one module per set."""
    sampler = ApiSetSampler(seed=seed)
    buildable = synth_catalog(teachable=False)
    api_sets = sampler.sample_many(sets)
    samples = await backend.generate([proposer_messages(s) for s in api_sets], n=1,
                                     sampling=sampling)
    loop = asyncio.get_running_loop()

    def check(i: int) -> tuple[int, ProposerReply]:
        text = samples[i][0].text
        source = extract_code(text, require="class Model") or text
        result = validate_module(source, api_sets[i])
        key = tuple(sorted(api_sets[i]))
        return i, ProposerReply(api_sets[i], result.valid, result.reason or "valid",
                                (result.detail or "")[-300:],
                                key in buildable.pairs or key in buildable.triples)

    replies: list[ProposerReply | None] = [None] * len(api_sets)
    with ThreadPoolExecutor(max(1, workers)) as pool:
        futures = [loop.run_in_executor(pool, check, i) for i in range(len(api_sets))]
        for done, fut in enumerate(asyncio.as_completed(futures), start=1):
            i, reply = await fut
            replies[i] = reply
            if on_progress is not None:
                on_progress(done, len(api_sets))
    return ProposerScore([r for r in replies if r is not None])
