"""``ByteBudget``: the host memory a device's verifier processes may hold together, and a
device's room (what its candidates and preparations are estimated to hold on it); what
says a child died for the host's memory."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kz_stream.verify._pool import ByteBudget


async def _enter(budget: ByteBudget, nbytes: int, entered: list[int],
                 leave: asyncio.Event) -> None:
    await budget.acquire(nbytes)
    try:
        entered.append(nbytes)
        await leave.wait()
    finally:
        budget.release(nbytes)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_holders_share_the_budget_and_the_next_waits_for_room() -> None:
    budget, entered, leave = ByteBudget(10), [], asyncio.Event()
    tasks = [asyncio.create_task(_enter(budget, n, entered, leave)) for n in (4, 5, 3)]
    await _settle()
    assert entered == [4, 5] and budget.held == 9
    leave.set()
    await asyncio.gather(*tasks)
    assert entered == [4, 5, 3] and budget.held == 0 and budget.holders == 0


async def test_a_request_larger_than_the_budget_runs_alone() -> None:
    budget, entered, leave = ByteBudget(10), [], asyncio.Event()
    big = asyncio.create_task(_enter(budget, 25, entered, leave))
    small = asyncio.create_task(_enter(budget, 1, entered, leave))
    await _settle()
    assert entered == [25]
    leave.set()
    await asyncio.gather(big, small)
    assert entered == [25, 1]


async def test_a_waiting_big_request_is_not_passed_by_later_small_ones() -> None:
    budget, entered = ByteBudget(10), []
    first, rest = asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(_enter(budget, 6, entered, first))
    await _settle()
    big = asyncio.create_task(_enter(budget, 8, entered, rest))
    await _settle()
    small = asyncio.create_task(_enter(budget, 2, entered, rest))  # would fit now
    await _settle()
    assert entered == [6]
    first.set()
    await _settle()
    assert entered == [6, 8, 2]
    rest.set()
    await asyncio.gather(holder, big, small)


async def test_later_requests_that_fit_pass_a_waiting_one_within_its_pass_window() -> None:
    budget, entered = ByteBudget(10, pass_s=3600), []
    first, rest = asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(_enter(budget, 6, entered, first))
    await _settle()
    big = asyncio.create_task(_enter(budget, 8, entered, rest))
    await _settle()
    small = asyncio.create_task(_enter(budget, 2, entered, rest))  # fits beside the holder
    queued = asyncio.create_task(_enter(budget, 3, entered, rest))  # does not: waits too
    await _settle()
    assert entered == [6, 2] and budget.waiting == 2
    first.set()
    await _settle()
    # The big one first: the small one still holds 2, so the next fits only after it.
    assert entered == [6, 2, 8]
    rest.set()
    await asyncio.gather(holder, big, small, queued)
    assert entered == [6, 2, 8, 3] and budget.held == 0 and budget.holders == 0


async def test_past_its_pass_window_a_waiting_request_is_passed_by_none() -> None:
    budget, entered = ByteBudget(10, pass_s=0.05), []
    first, rest = asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(_enter(budget, 6, entered, first))
    await _settle()
    big = asyncio.create_task(_enter(budget, 8, entered, rest))
    await asyncio.sleep(0.1)  # past its window
    small = asyncio.create_task(_enter(budget, 2, entered, rest))
    await _settle()
    assert entered == [6]
    first.set()
    await _settle()
    assert entered == [6, 8, 2]
    rest.set()
    await asyncio.gather(holder, big, small)


async def test_a_request_first_in_line_is_never_passed() -> None:
    budget, entered = ByteBudget(10, pass_s=3600), []
    first, rest = asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(_enter(budget, 6, entered, first))
    await _settle()

    async def whole() -> None:  # a retry that needs the device to itself
        await budget.acquire(11, first=True)
        entered.append(11)
        await rest.wait()
        budget.release(11)

    retry = asyncio.create_task(whole())
    await _settle()
    small = asyncio.create_task(_enter(budget, 2, entered, rest))
    await _settle()
    assert entered == [6]
    first.set()
    await _settle()
    assert entered == [6, 11]
    rest.set()
    await asyncio.gather(holder, retry, small)
    assert entered == [6, 11, 2]


async def test_a_request_first_in_line_goes_before_those_already_waiting() -> None:
    budget, entered, leave = ByteBudget(10), [], asyncio.Event()
    holder = asyncio.create_task(_enter(budget, 6, entered, asyncio.Event()))
    await _settle()
    queued = asyncio.create_task(_enter(budget, 5, entered, leave))
    await _settle()

    async def whole() -> None:  # a retry that needs the device to itself
        await budget.acquire(10, first=True)
        entered.append(10)
        budget.release(10)

    retry = asyncio.create_task(whole())
    await _settle()
    assert entered == [6]  # the retry waits for the holder, not for the one queued
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)
    await _settle()
    assert entered == [6, 10, 5]
    leave.set()
    await asyncio.gather(retry, queued)
    assert budget.held == 0 and budget.holders == 0


async def test_giving_up_while_waiting_holds_nothing() -> None:
    budget, entered, leave = ByteBudget(10), [], asyncio.Event()
    holder = asyncio.create_task(_enter(budget, 9, entered, leave))
    await _settle()
    waiter = asyncio.create_task(_enter(budget, 5, entered, leave))
    after = asyncio.create_task(_enter(budget, 1, entered, leave))
    await _settle()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await _settle()
    assert entered == [9, 1]  # the one behind it fits and goes in
    leave.set()
    await asyncio.gather(holder, after)
    assert budget.held == 0 and budget.holders == 0


def test_only_a_sigkill_while_the_oom_killer_worked_is_a_death_for_memory() -> None:
    from kz_stream.verify._checks import killed_for_memory, oom_kills
    from kz_stream.verify._ipc import ChildDied

    now = oom_kills()
    sigkill, crash = ChildDied("gone", "", -9), ChildDied("gone", "", 1)
    assert not killed_for_memory(crash, None)
    assert killed_for_memory(sigkill, None)  # the host does not count: any SIGKILL
    if now is not None:
        assert not killed_for_memory(sigkill, now)  # killed by someone else
        assert killed_for_memory(sigkill, now - 1)


async def test_a_holder_that_shrinks_lets_the_next_one_in() -> None:
    budget, entered, leave = ByteBudget(10), [], asyncio.Event()
    await budget.acquire(8)  # a problem's preparation at its peak
    waiter = asyncio.create_task(_enter(budget, 5, entered, leave))
    await _settle()
    assert entered == []
    budget.shrink(6)  # prepared: it holds 2 from now on
    await _settle()
    assert entered == [5] and budget.held == 7 and budget.holders == 2
    budget.release(2)
    leave.set()
    await waiter
    assert budget.held == 0 and budget.holders == 0


def test_a_prepared_reduction_holds_its_sets_and_what_its_candidates_exchange() -> None:
    import types

    from kz_stream.verify._verifier import held_after_preparation

    gib = 1 << 30
    big, small = torch.empty(2 * gib, dtype=torch.uint8), torch.empty(1000, dtype=torch.uint8)
    own = {"inputs": [big, small, 3], "honest": [torch.empty(4096, dtype=torch.uint8)]}
    tiny = {"inputs": [small], "honest": [torch.empty(10, dtype=torch.uint8)]}
    p = types.SimpleNamespace(sets=[own, tiny], host_bytes=2 * gib + 5000)
    # The 2 GiB input is mapped by the workers (shared), the rest is sent to each of 3.
    assert held_after_preparation(p, 16 << 20, 3) == 2 * gib + 5000 + 3 * (1000 + 4 * 4096)
    # With sharing off, every input goes to every candidate as bytes.
    assert held_after_preparation(p, None, 3) == 2 * gib + 5000 + 3 * (2 * gib + 1000
                                                                       + 4 * 4096)


def test_a_stage_counts_its_checks_and_what_its_timing_adds() -> None:
    from kz_stream.verify._verifier import CUDA_CONTEXT_BYTES, StageRoom, stage_device_bytes

    gib, mib = 1 << 30, 1 << 20
    rest = 4 * (4 * mib) + CUDA_CONTEXT_BYTES
    # An 8 GiB reduction checked on scaled-down sets of 128 MiB (cloned; the 8 GiB input is
    # checked by block sums): set 0 and one small set with its clone; the second timing set
    # is the rest of its timing.
    assert stage_device_bytes(8 * gib, 128 * mib, 128 * mib, 4 * mib, 0, 2) == StageRoom(
        8 * gib + 256 * mib + rest, 8 * gib - 256 * mib)
    # Every set at full size: set 0 beside another already holds two timing sets' worth.
    assert stage_device_bytes(6 * gib, 6 * gib, 0, 4 * mib, 0, 2) == StageRoom(
        12 * gib + rest, 0)
    # Small inputs rotate through more sets; never fewer than two.
    assert stage_device_bytes(100, 100, 100, 10, 7, 20) == StageRoom(
        300 + 40 + 7 + CUDA_CONTEXT_BYTES, 1700)
    assert stage_device_bytes(100, 0, 0, 0, 0, 1) == StageRoom(100 + CUDA_CONTEXT_BYTES, 100)


def test_a_worker_clones_only_the_inputs_up_to_a_gibibyte() -> None:
    from kz_stream.verify._inputs import CLONE_MAX_BYTES, cloned_bytes

    big = torch.empty(CLONE_MAX_BYTES + 4, dtype=torch.uint8, device="meta")
    small = torch.empty(1000, dtype=torch.uint8)
    assert cloned_bytes([big, small, 3, small]) == 1000  # one storage, counted once
    assert cloned_bytes([torch.empty(CLONE_MAX_BYTES, dtype=torch.uint8, device="meta")]) == (
        CLONE_MAX_BYTES)


def test_a_lanes_timing_room_is_a_share_of_its_room() -> None:
    from kz_stream.verify import VerifierConfig
    from kz_stream.verify._pool import _NO_LIMIT, TIMING_ROOM_SHARE, Lane

    lane = Lane(VerifierConfig(devices=[], prewarm=0), None)
    try:
        assert lane.timing_room.limit == int(TIMING_ROOM_SHARE * _NO_LIMIT)
        assert lane.room.limit + lane.timing_room.limit == _NO_LIMIT
        assert lane.occupancy()["timing_room_bytes"] == 0
    finally:
        lane.close()


def test_a_preparation_counts_float64_copies_up_to_the_oracles_cap() -> None:
    from kz_stream.verify._verifier import CUDA_CONTEXT_BYTES, preparation_device_bytes

    gib = 1 << 30
    assert preparation_device_bytes(gib, 3 << 20, 2, 100 * gib) == (
        3 * gib + (3 << 20) + 6 + CUDA_CONTEXT_BYTES)
    # Outputs the meta device could not find count as three times the inputs.
    assert preparation_device_bytes(gib, None, 0, 100 * gib) == 6 * gib + CUDA_CONTEXT_BYTES
    assert preparation_device_bytes(8 * gib, None, 0, 32 * gib) == 32 * gib


def test_a_devices_room_leaves_out_the_reference_workers_and_a_margin() -> None:
    from kz_stream.verify._pool import device_room_bytes

    gib = 1 << 30
    assert device_room_bytes(100 * gib, 16 * gib) == 74 * gib
    assert device_room_bytes(16 * gib, 16 * gib) == 4 * gib  # never below a quarter


def test_an_admission_check_counts_its_sets_at_the_size_it_checks_them() -> None:
    from kz_stream.verify._admission import admission_device_bytes

    mib, gib = 1 << 20, 1 << 30
    # Five sets' worth of inputs and outputs (honest and float64), the weights three times.
    assert admission_device_bytes(100 * mib, 30 * mib, 2, 0.125) == 5 * 130 * mib + 6
    # Unknown outputs count as three times the inputs.
    assert admission_device_bytes(100 * mib, None, 0, 0.125) == 5 * 400 * mib
    # Up to the unscaled bound a check may run at full size; past it, at the small share.
    assert admission_device_bytes(gib + gib // 2, 0, 0, 0.125) == 5 * (gib + gib // 2)
    assert admission_device_bytes(8 * gib, 0, 0, 0.125) == 5 * gib
    # Sizes the meta device could not find: the largest check a GPU runs unscaled.
    assert admission_device_bytes(None, None, 1, 1.0) == 30 * gib + 3


def test_the_host_memory_and_each_devices_room_are_passed_within_the_configured_window(
) -> None:
    from kz_stream.verify import Verifier, VerifierConfig
    from kz_stream.verify._pool import Lane

    config = VerifierConfig(devices=[], pass_window_s=7, prewarm=0)
    lane = Lane(config, None)
    try:
        assert lane.room.pass_s == 7
    finally:
        lane.close()
    assert Verifier(config)._host.pass_s == 7
    assert ByteBudget(10).pass_s == 0  # strictly in turn unless asked
