"""The Proposer's valid-module rate: sample API sets, ask the policy for a module each, and
validate every reply as the Proposer service does (``validate_module``: the APIs called,
a sandboxed run, admission)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kz_stream.llm import LLMBackend, SamplingParams
from kz_stream.modules import ApiSetSampler, extract_code, proposer_messages, validate_module
from kz_stream.warmstart.synth import synth_catalog

__all__ = ["ProposerScore", "score_proposer"]


@dataclass
class ProposerScore:
    """Valid replies over all replies, overall and on the sets the synthesizer can build
    (with the Proposer-only ops: the sets the Proposer's SFT data covers)."""

    sets: int = 0
    valid: int = 0
    buildable_sets: int = 0
    buildable_valid: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    # one per set, in draw order: api_set, valid, reason, detail (the validator's, cut)
    records: list[dict[str, object]] = field(default_factory=list)

    @property
    def valid_rate(self) -> float:
        return self.valid / self.sets if self.sets else 0.0

    @property
    def buildable_valid_rate(self) -> float:
        return self.buildable_valid / self.buildable_sets if self.buildable_sets else 0.0


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
    score = ProposerScore()
    loop = asyncio.get_running_loop()

    def check(i: int) -> tuple[int, bool, str, str]:
        text = samples[i][0].text
        source = extract_code(text, require="class Model") or text
        result = validate_module(source, api_sets[i])
        return i, result.valid, result.reason or "valid", (result.detail or "")[-300:]

    records: list[dict[str, object]] = [{} for _ in api_sets]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        futures = [loop.run_in_executor(pool, check, i) for i in range(len(api_sets))]
        for done, fut in enumerate(asyncio.as_completed(futures), start=1):
            i, valid, reason, detail = await fut
            records[i] = {"api_set": api_sets[i], "valid": valid, "reason": reason,
                          "detail": detail}
            key = tuple(sorted(api_sets[i]))
            is_buildable = key in buildable.pairs or key in buildable.triples
            score.sets += 1
            score.valid += valid
            score.buildable_sets += is_buildable
            score.buildable_valid += valid and is_buildable
            score.reasons[reason] += 1
            if on_progress is not None:
                on_progress(done, len(api_sets))
    score.records = records
    return score
