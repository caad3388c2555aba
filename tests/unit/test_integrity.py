"""A run's history replayed: every event lost or applied twice across the slots of a
resumed run is found, and a run with none passes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from kz_stream.events import (
    Event,
    KernelGenerated,
    KernelVerified,
    Payload,
    PolicyVersionPublished,
    TrainingStepCompleted,
    WorkRedelivered,
    new_event,
)
from kz_stream.integrity import check_slots, load_events
from kz_stream.store import open_store

T0 = datetime(2026, 12, 4, tzinfo=UTC)


class Timeline:
    """Events of one run, each ``at`` seconds after T0."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def add(self, at: float, payload: Payload) -> None:
        self.events.append(new_event(payload, stream_id=f"s-{len(self.events)}",
                                     stream_version=0, correlation_id="run-1",
                                     occurred_at=T0 + timedelta(seconds=at)))

    def kernel(self, at: float, kernel_id: str) -> None:
        self.add(at, KernelGenerated(kernel_id=kernel_id, module_id="m", group_id=f"g-{kernel_id}",
                                     backend="triton", source="..."))

    def verdict(self, at: float, kernel_id: str) -> None:
        self.add(at, KernelVerified(kernel_id=kernel_id, module_id="m", group_id=f"g-{kernel_id}",
                                    status="correct", verifier_version="kzv-test"))

    def step(self, at: float, step: int, kernel_ids: list[str], version: int | None = None,
             role: str = "coder", module_ids: list[str] | None = None) -> None:
        version = step if version is None else version
        self.add(at, TrainingStepCompleted(role=role, step=step, policy_version=version,
                                           kernel_ids=kernel_ids, module_ids=module_ids or [],
                                           group_ids=[f"g-{k}" for k in kernel_ids]))
        self.add(at, PolicyVersionPublished(role=role, version=version, uri=f"v{version}",
                                                  sha256="0" * 64))


def three_slots() -> Timeline:
    t = Timeline()
    t.kernel(0, "a")
    t.verdict(5, "a")
    t.kernel(10, "b")  # verified only in the next slot: carried over, not lost
    t.step(12, 1, ["a"])
    t.verdict(600, "b")
    t.kernel(605, "c")
    t.verdict(610, "c")
    t.step(615, 2, ["b", "c"])
    t.kernel(1200, "d")  # in flight when the run stopped
    return t


def test_a_run_resumed_over_three_slots_with_nothing_lost_passes() -> None:
    r = check_slots(three_slots().events, gap_s=90)
    assert r["ok"], r
    assert [s["seconds"] for s in r["slots"]] == [12.0, 15.0, 0.0]
    assert r["slots"][1]["verdicts_of_earlier_slots"] == 1
    assert r["lost"] == [] and r["in_flight_at_end"] == 1
    assert r["roles"]["coder"]["steps"] == 2


def test_the_roles_steps_are_one_sequence_and_their_versions_one_each() -> None:
    t = three_slots()
    t.step(1210, 3, [], version=1, role="proposer")
    r = check_slots(t.events, gap_s=90)
    assert r["ok"], r
    assert r["schedule"]["steps"] == 3
    assert r["roles"]["proposer"]["versions_published"] == 1


def test_a_kernel_of_an_earlier_slot_never_verified_is_lost() -> None:
    t = three_slots()
    t.kernel(11, "x")
    r = check_slots(t.events, gap_s=90)
    assert not r["ok"] and r["lost"] == ["x"]


def test_an_earlier_slots_kernel_the_last_slot_sent_again_is_in_flight_not_lost() -> None:
    # The last slot re-published the backlog and stopped before judging all of it.
    t = three_slots()
    t.kernel(11, "x")
    t.kernel(606, "y")
    t.add(1199, WorkRedelivered(kernel_ids=["x", "y"]))
    r = check_slots(t.events, gap_s=90)
    assert r["ok"], r
    assert r["lost"] == [] and r["in_flight_at_end"] == 3  # x, y and the last slot's d
    assert r["slots"][2]["kernels_redelivered"] == 2


def test_a_kernel_sent_again_by_an_earlier_slot_but_not_the_last_is_lost() -> None:
    # Slot 2 re-sent x; slot 3 found it still unfinished and did not: the store lost it
    # between, or slot 3's redelivery missed it.
    t = three_slots()
    t.kernel(11, "x")
    t.add(599, WorkRedelivered(kernel_ids=["x"]))
    r = check_slots(t.events, gap_s=90)
    assert not r["ok"] and r["lost"] == ["x"]


def test_events_applied_twice_are_each_reported() -> None:
    t = three_slots()
    t.verdict(1201, "d")
    t.verdict(1202, "d")  # a second verdict of one verifier version
    t.kernel(1203, "a")  # generated again
    t.step(1204, 2, ["a"])  # step 2 again, on a kernel step 1 trained on
    r = check_slots(t.events, gap_s=90)
    assert not r["ok"]
    assert r["verified_twice"] == [["d", "kzv-test"]]
    assert r["generated_twice"] == ["a"]
    assert r["schedule"]["steps_repeated"] == [2]
    assert r["roles"]["coder"]["versions_repeated"] == [2]
    assert r["trained_twice"]["coder_kernel_ids"] == ["a"]


def test_a_skipped_step_or_version_is_reported() -> None:
    t = three_slots()
    t.add(1300, TrainingStepCompleted(role="coder", step=4, policy_version=4))
    r = check_slots(t.events, gap_s=90)
    assert not r["ok"]
    assert r["schedule"]["steps_missing"] == [3]
    assert r["roles"]["coder"]["steps_of_unpublished_versions"] == [4]


def test_a_skipped_version_is_reported() -> None:
    t = three_slots()
    t.step(1300, 3, [], version=4)  # version 3 never published
    r = check_slots(t.events, gap_s=90)
    assert not r["ok"] and r["roles"]["coder"]["versions_missing"] == [3]


def test_a_proposed_module_trained_on_twice_is_reported() -> None:
    t = three_slots()
    t.step(1210, 3, [], version=1, role="proposer", module_ids=["p1", "p2"])
    t.step(1220, 4, [], version=2, role="proposer", module_ids=["p2"])
    r = check_slots(t.events, gap_s=90)
    assert not r["ok"] and r["trained_twice"]["proposer_module_ids"] == ["p2"]


def test_a_coder_module_trained_on_through_two_groups_is_not_twice() -> None:
    # Every kernel of the timeline is of module "m", in a group of its own.
    t = three_slots()
    t.verdict(1205, "d")
    t.kernel(1206, "e")
    t.verdict(1207, "e")
    t.step(1210, 3, ["d"], module_ids=["m"])
    t.step(1215, 4, ["e"], module_ids=["m"])
    r = check_slots(t.events, gap_s=90)
    assert r["ok"], r
    assert "coder_module_ids" not in r["trained_twice"]


def test_a_verdict_of_a_kernel_never_generated_is_reported() -> None:
    t = three_slots()
    t.verdict(1201, "ghost")
    r = check_slots(t.events, gap_s=90)
    assert not r["ok"] and r["verdicts_of_unknown_kernels"] == ["ghost"]


async def test_a_store_is_read_back_for_its_one_run_or_the_run_named(store_url: str) -> None:
    other = Timeline()
    other.kernel(0, "z")
    async with open_store(store_url) as store:
        await store.append(three_slots().events)
        await store.append([e.model_copy(update={"correlation_id": "run-2", "stream_id": "other"})
                            for e in other.events])
    with pytest.raises(LookupError, match="2 runs"):
        await load_events(store_url, None)
    run_id, events = await load_events(store_url, "run-1")
    assert run_id == "run-1" and check_slots(events, gap_s=90)["ok"]
    assert sorted(e.payload["kernel_id"] for e in events if e.type == "KernelGenerated") == [
        "a", "b", "c", "d"]
