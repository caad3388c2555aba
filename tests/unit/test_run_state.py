"""The run projection, capability map and frontier, on events the test makes."""

from __future__ import annotations

from kz_stream.events import (
    Completion,
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    ModuleValidation,
    TrainingStepCompleted,
    VerdictStatus,
    new_event,
)
from kz_stream.run_state import CapabilityMap, RunState, compute_frontier


def module(mid: str, apis: list[str]) -> ModuleProposed:
    return ModuleProposed(
        module_id=mid,
        api_set=apis,
        source="class Model: ...",
        validation=ModuleValidation(valid=True),
    )


def kernel(kid: str, mid: str, gid: str, size: int = 2, version: int = 0) -> KernelGenerated:
    return KernelGenerated(
        kernel_id=kid,
        module_id=mid,
        group_id=gid,
        group_size=size,
        backend="triton",
        source="...",
        policy_version=version,
    )


def verdict(
    kid: str, mid: str, gid: str, status: VerdictStatus, speedup: float | None = None
) -> KernelVerified:
    return KernelVerified(
        kernel_id=kid, module_id=mid, group_id=gid, status=status, speedup=speedup
    )


def state_of(*payloads: object) -> RunState:
    state = RunState()
    for i, p in enumerate(payloads):
        state.apply(new_event(p, stream_id=f"s{i}", stream_version=0), recorded_at=0.0)  # type: ignore[arg-type]
    return state


C, X = VerdictStatus.CORRECT, VerdictStatus.INCORRECT


def test_a_group_is_ready_once_every_member_has_a_verdict() -> None:
    state = state_of(
        module("m", ["torch.relu", "torch.matmul"]),
        kernel("k1", "m", "g"),
        kernel("k2", "m", "g"),
        verdict("k1", "m", "g", C, 1.2),
    )
    assert state.ready_groups(now=1.0) == []
    state.apply(new_event(verdict("k2", "m", "g", X), stream_id="x", stream_version=0))
    assert [g.group_id for g in state.ready_groups(now=1.0)] == ["g"]


def test_a_verdict_stored_before_its_kernel_counts_when_the_kernel_comes() -> None:
    # The verifier appends as it judges; the recorder, lagging or down, stores the kernel later.
    state = state_of(
        module("m", ["torch.relu"]),
        verdict("k1", "m", "g", X),
        verdict("k1", "m", "g", C, 1.5),  # a second verdict (re-scoring): the newest wins
        kernel("k1", "m", "g", size=1),
    )
    k = state.kernels["k1"]
    assert k.verdict is not None and k.verdict.status is C and k.decided
    assert [g.group_id for g in state.ready_groups(now=1.0)] == ["g"]
    assert state.early_verdicts == {}


def test_a_coder_step_trains_on_decided_verdicts_only() -> None:
    state = state_of(
        module("m", ["torch.relu"]),
        *(kernel(k, "m", "g", size=4) for k in ("k1", "k2", "k3", "k4")),
        verdict("k1", "m", "g", C, 1.2),
        verdict("k2", "m", "g", X),
        verdict("k3", "m", "g", VerdictStatus.INFRA_ERROR),  # the verifier failed itself
        verdict("k4", "m", "g", VerdictStatus.UNCHECKED),  # could not be checked here
    )
    [g] = state.ready_groups(now=1.0)
    assert [k.kernel_id for k in g.decided_kernels(state.kernels)] == ["k1", "k2"]
    only_undecided = state_of(
        module("m", ["torch.relu"]), kernel("k1", "m", "g", size=1),
        verdict("k1", "m", "g", VerdictStatus.INFRA_ERROR))
    [g] = only_undecided.ready_groups(now=1.0)
    assert g.decided_kernels(only_undecided.kernels) == []


def test_a_group_missing_some_verdicts_is_ready_after_its_timeout() -> None:
    state = state_of(module("m", ["torch.relu"]), kernel("k1", "m", "g"), kernel("k2", "m", "g"),
                     verdict("k1", "m", "g", C, 1.0))
    assert state.ready_groups(timeout_s=10, now=5.0) == []
    assert len(state.ready_groups(timeout_s=10, now=11.0)) == 1


def test_a_group_with_no_verdict_is_never_ready_it_has_nothing_to_learn_from() -> None:
    state = state_of(module("m", ["torch.relu"]), kernel("k1", "m", "g"), kernel("k2", "m", "g"))
    assert state.ready_groups(timeout_s=10, now=1e9) == []


def test_a_resumed_runs_timeouts_count_from_when_it_began_waiting() -> None:
    # The last session's kernels went to this session's verifier again: their groups wait
    # ``timeout_s`` from the learner's start, not from when they were generated.
    state = state_of(module("m", ["torch.relu"]), kernel("k1", "m", "g"), kernel("k2", "m", "g"),
                     verdict("k1", "m", "g", C, 1.0))
    state.waiting_since = 1000.0
    assert state.ready_groups(timeout_s=10, now=1005.0) == []
    assert len(state.ready_groups(timeout_s=10, now=1011.0)) == 1


def test_a_group_named_by_a_training_step_is_not_ready_again() -> None:
    state = state_of(
        module("m", ["torch.relu"]),
        kernel("k1", "m", "g", size=1),
        verdict("k1", "m", "g", C, 1.0),
        TrainingStepCompleted(role="coder", step=1, policy_version=1, group_ids=["g"]),
    )
    assert state.ready_groups(now=1.0) == []


def proposal(mid: str, gid: str, valid: bool) -> ModuleProposed:
    return ModuleProposed(
        module_id=mid, api_set=["torch.relu"], source="class Model: ...", group_id=gid,
        completion=Completion(text="...", token_ids=[1], logprobs=[-0.5]),
        validation=ModuleValidation(valid=valid, reason=None if valid else "crash"),
    )


def test_a_proposal_group_is_being_scored_once_the_coder_took_up_its_valid_modules() -> None:
    state = state_of(
        proposal("m1", "p1", valid=False), proposal("m2", "p1", valid=False),
        proposal("m3", "p2", valid=True), proposal("m4", "p2", valid=False),
        proposal("m5", "p3", valid=True),  # the Coder has not reached it: no kernels
    )
    # p1 all invalid: nothing to wait for; p3's module is not taken up.
    assert state.proposal_readiness(now=1.0) == (["p1"], 0)
    state.apply(new_event(kernel("k1", "m3", "g", size=1), stream_id="k", stream_version=0))
    assert state.proposal_readiness(now=1.0) == (["p1"], 1)
    state.apply(new_event(verdict("k1", "m3", "g", C, 1.0), stream_id="x", stream_version=0))
    assert state.proposal_readiness(now=1.0) == (["p1", "p2"], 0)


def test_an_event_applied_as_it_was_stored_counts_once_when_read_back() -> None:
    from datetime import UTC, datetime

    from kz_stream.store import RecordedEvent

    state = RunState()
    step = new_event(TrainingStepCompleted(role="coder", step=1, policy_version=1,
                                           group_ids=[]), stream_id="s", stream_version=0)
    state.apply_own(step)
    assert state.training_steps == 1
    state.apply_all([RecordedEvent(7, datetime.now(UTC), step)])
    assert state.training_steps == 1
    assert state.counts["TrainingStepCompleted"] == 1
    assert state.position == 7
    assert state.applied_ahead == set()  # nothing is held once read back


def test_module_correctness_is_the_mean_over_decided_samples() -> None:
    state = state_of(
        module("m", ["torch.relu"]),
        kernel("k1", "m", "g", 3),
        kernel("k2", "m", "g", 3),
        kernel("k3", "m", "g", 3),
        verdict("k1", "m", "g", C, 1.0),
        verdict("k2", "m", "g", X),
        verdict("k3", "m", "g", VerdictStatus.UNCHECKED),
    )
    assert state.module_correctness() == {"m": 0.5}


def test_capability_map_counts_each_api_and_pair_of_a_module() -> None:
    state = state_of(
        module("m1", ["torch.relu", "torch.matmul"]),
        module("m2", ["torch.relu"]),
        kernel("a", "m1", "g1"),
        kernel("b", "m2", "g2"),
        verdict("a", "m1", "g1", C, 0.5),
        verdict("b", "m2", "g2", X),
    )
    cmap = CapabilityMap.from_state(state)
    assert (cmap.apis["torch.relu"].n, cmap.apis["torch.relu"].correct) == (2, 1)
    assert cmap.apis["torch.matmul"].pass_rate == 1.0
    assert cmap.pairs["torch.matmul+torch.relu"].n == 1
    assert cmap.apis["torch.matmul"].median_speedup == 0.5


def test_the_frontier_ranks_weak_apis_first_and_flags_correct_but_slow_ones() -> None:
    state = state_of(
        module("m1", ["torch.matmul"]),
        module("m2", ["torch.softmax"]),
        kernel("a", "m1", "g1", 2),
        kernel("b", "m1", "g1", 2),
        kernel("c", "m2", "g2", 2),
        kernel("d", "m2", "g2", 2),
        verdict("a", "m1", "g1", C, 0.8),
        verdict("b", "m1", "g1", C, 0.9),
        verdict("c", "m2", "g2", X),
        verdict("d", "m2", "g2", X),
    )
    f = compute_frontier(state)
    # smoothed pass rates: matmul (2+1)/(2+2) = 0.75, softmax (0+1)/(2+2) = 0.25
    assert f.weak_apis == {"torch.softmax": 0.75, "torch.matmul": 0.25}
    assert f.slow_apis == {"torch.matmul": 1.0}
    assert f.module_correctness == {"m1": 1.0, "m2": 0.0}
    assert f.frontier_version == 1
