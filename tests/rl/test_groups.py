"""Samples, groups and the batch built from complete groups."""

from __future__ import annotations

import math

import pytest

from kz_stream.events import (
    Completion,
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    ModuleValidation,
    VerdictStatus,
)
from kz_stream.rl.groups import (
    Group,
    Sample,
    build_batch,
    group_samples,
    proposer_step_groups,
)


def _sample(gid: str, i: int, version: int = 5, **kw: object) -> Sample:
    fields: dict[str, object] = {
        "group_id": gid,
        "prompt": "p",
        "completion_ids": (1, 2),
        "logprobs": (-0.1, -0.2),
        "policy_version": version,
        "kernel_id": f"{gid}-k{i}",
        "module_id": "m",
        "correct": True,
    }
    fields.update(kw)
    return Sample(**fields)  # type: ignore[arg-type]


def test_problem() -> None:
    assert _sample("g", 0).problem() is None
    assert _sample("g", 0, completion_ids=()).problem() == "empty completion"
    assert "logprobs" in (_sample("g", 0, logprobs=(-0.1,)).problem() or "")
    assert _sample("g", 0, logprobs=(math.inf, 0.0)).problem() == "a logprob is +inf"
    assert _sample("g", 0, prompt_ids=()).problem() == "empty prompt_ids"


def test_from_kernel_events() -> None:
    gen = KernelGenerated(
        kernel_id="k1",
        module_id="m1",
        group_id="g1",
        backend="triton",
        source="...",
        prompt="write ModelNew",
        policy_version=3,
        completion=Completion(text="x", token_ids=[5, 6, 7], logprobs=[-0.5, -0.25, -1.0]),
    )
    ver = KernelVerified(
        kernel_id="k1",
        module_id="m1",
        group_id="g1",
        status=VerdictStatus.CORRECT,
        speedup=1.5,
        speedup_ci=(1.2, 1.8),
    )
    s = Sample.from_kernel(gen, ver, prompt_ids=[1, 2])
    assert s.completion_ids == (5, 6, 7) and s.logprobs == (-0.5, -0.25, -1.0)
    assert s.prompt_ids == (1, 2) and s.policy_version == 3 and s.sample_id == "k1"
    assert s.correct is True and s.speedup_ci == (1.2, 1.8)
    wrong = Sample.from_kernel(gen, ver.model_copy(update={"status": VerdictStatus.HACK}))
    assert wrong.correct is False
    for undecided in (VerdictStatus.UNCHECKED, VerdictStatus.INFRA_ERROR):  # no reward
        assert Sample.from_kernel(gen, ver.model_copy(update={"status": undecided})).correct is None
    with pytest.raises(ValueError, match="kernel_id"):
        Sample.from_kernel(gen, ver.model_copy(update={"kernel_id": "k2"}))
    bare = Sample.from_kernel(gen.model_copy(update={"completion": None}), ver)
    assert bare.problem() == "empty completion"


def test_from_module_event() -> None:
    mod = ModuleProposed(
        module_id="m1",
        api_set=["torch.relu", "torch.matmul"],
        source="class Model...",
        prompt="write a module",
        policy_version=2,
        completion=Completion(text="x", token_ids=[9], logprobs=[-0.3]),
        validation=ModuleValidation(valid=False, reason="degenerate"),
    )
    s = Sample.from_module(mod, group_id="apis-1", mean_correctness=None)
    assert s.sample_id == "m1" and s.module_valid is False and s.kernel_id == ""


def test_group_samples_and_accuracy() -> None:
    samples = [
        _sample("a", 0),
        _sample("b", 0, correct=False),
        _sample("a", 1, correct=False),
        _sample("b", 1, correct=False),
    ]
    groups = group_samples(samples)
    assert [g.group_id for g in groups] == ["a", "b"]
    assert groups[0].accuracy == 0.5 and groups[1].accuracy == 0.0
    with pytest.raises(ValueError):
        Group("a", (_sample("b", 0),))


def test_build_batch_filters_and_counts() -> None:
    fresh = Group("fresh", tuple(_sample("fresh", i, version=9) for i in range(3)))
    mixed = Group(
        "mixed",
        (
            _sample("mixed", 0, version=10),
            _sample("mixed", 1, version=4),  # 6 behind: stale
            _sample("mixed", 2, version=10, logprobs=(-0.1,)),  # broken
            _sample("mixed", 3, version=8),
        ),
    )
    lonely = Group("lonely", (_sample("lonely", 0, version=10), _sample("lonely", 1, version=1)))
    batch = build_batch([fresh, mixed, lonely], policy_version=10, max_staleness=4)
    assert batch.group_ids == ["fresh", "mixed"]
    assert [s.kernel_id for s in batch.groups[1].samples] == ["mixed-k0", "mixed-k3"]
    assert batch.dropped_stale == 2  # mixed-k1 and lonely-k1
    assert batch.dropped_invalid == 1
    assert batch.dropped_groups == 1  # lonely is left with one sample
    assert batch.kernel_ids == ["fresh-k0", "fresh-k1", "fresh-k2", "mixed-k0", "mixed-k3"]
    assert batch.module_ids == ["m"]
    # ages 1, 1, 1, 0, 2
    assert batch.staleness == {"min": 0.0, "mean": pytest.approx(1.0), "max": 2.0}


def test_build_batch_needs_two() -> None:
    with pytest.raises(ValueError):
        build_batch([], policy_version=0, max_staleness=1, min_group_size=1)


def _proposals(gid: str, *verdicts: tuple[bool, float | None]) -> Group:
    """A Proposer group: one (valid, the Coder's mean correctness) per proposal."""
    return Group(gid, tuple(
        _sample(gid, i, kernel_id="", module_id=f"{gid}-m{i}", correct=None,
                module_valid=valid, mean_correctness=lbar)
        for i, (valid, lbar) in enumerate(verdicts)))


INVALID = (False, None)


def test_a_proposer_step_takes_groups_whose_rewards_differ_oldest_first() -> None:
    all_invalid = _proposals("old", INVALID, INVALID)
    mixed = _proposals("mixed", (True, 0.0), INVALID)  # rewards 0 and -1
    equally_hard = _proposals("hard", (True, 0.0), (True, 1.0))  # rewards 0 and 0
    frontier = _proposals("frontier", (True, 0.5), (True, 0.0))  # rewards 1 and 0
    # A valid module whose Coder verdicts were all undecided is unscored: -1 and None are
    # one reward, not two.
    unscored = _proposals("unscored", (True, None), INVALID)
    ready = [all_invalid, unscored, mixed, equally_hard, frontier]
    chosen = proposer_step_groups(ready, 2, invalid_reward=-1.0, waiting=True)
    assert [g.group_id for g in chosen] == ["mixed", "frontier"]


def test_a_proposer_step_waits_for_groups_still_being_scored_rather_than_train_on_none() -> None:
    # Every proposal invalid: zero advantage everywhere, a step that teaches nothing.
    ready = [_proposals("a", INVALID, INVALID), _proposals("b", (True, 0.5), INVALID)]
    assert proposer_step_groups(ready, 2, invalid_reward=-1.0, waiting=True) == []


def test_with_nothing_left_to_score_groups_of_equal_rewards_fill_the_step() -> None:
    ready = [_proposals("a", INVALID, INVALID), _proposals("b", (True, 0.5), INVALID),
             _proposals("c", INVALID, INVALID)]
    chosen = proposer_step_groups(ready, 2, invalid_reward=-1.0, waiting=False)
    assert [g.group_id for g in chosen] == ["b", "a"]
    assert len(proposer_step_groups(ready[:1], 2, invalid_reward=-1.0, waiting=False)) == 1


def test_a_group_expires_when_its_samples_are_too_stale_to_train_on() -> None:
    group = Group("g", (_sample("g", 0, version=3), _sample("g", 1, version=3)))
    assert not group.expired(policy_version=6, max_staleness=3)
    assert group.expired(policy_version=6, max_staleness=2)  # three behind, two allowed
    assert group.expired(policy_version=10, max_staleness=4)
    assert not Group("empty", ()).expired(policy_version=10, max_staleness=0)
    # An expired group is one build_batch would drop whole.
    batch = build_batch([group], policy_version=10, max_staleness=4)
    assert batch.group_ids == [] and batch.dropped_groups == 1
