"""The worker's per-call checks hold little device memory beside the candidate's own: an
honest kernel of an 8 GiB KernelBench input must fit a worker's allowance on an H100."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Sequence

import pytest
import torch

from kz_stream.verify import VerifierConfig, _harness, _timing
from kz_stream.verify._harness import _pristine, _snapshot, _still_changing, bits_equal
from kz_stream.verify._pool import Lane


def test_bits_equal_compares_block_by_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_harness, "_EQUAL_BLOCK_BYTES", 16)
    a = torch.arange(64, dtype=torch.float32)
    b = a.clone()
    assert bits_equal(a, b)
    b[-1] = 0.0  # in the last of sixteen blocks
    assert not bits_equal(a, b)
    nan = torch.full((5,), float("nan"))
    assert bits_equal(nan, nan.clone())
    assert bits_equal(torch.tensor(2.5), torch.tensor(2.5))  # a 0-dim loss
    assert not bits_equal(a, a.reshape(8, 8))
    assert bits_equal(a.reshape(8, 8).t(), a.reshape(8, 8).t().contiguous())


def test_a_big_device_input_is_checked_against_its_host_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sent = torch.ones(64)
    arg = sent.clone()  # stands in for its copy on the device
    monkeypatch.setattr(_harness, "_on_device", lambda t, cuda: False)
    assert _pristine(arg, sent, cuda=True) is sent
    monkeypatch.setattr(_harness, "_on_device", lambda t, cuda: True)
    kept = _pristine(arg, sent, cuda=True)
    assert kept is not arg and torch.equal(kept, arg)
    assert _pristine(3, 3, cuda=True) == 3


def test_the_checks_copy_on_the_device_where_three_times_the_tensor_fits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_harness, "_CLONE_MAX_BYTES", 100)
    device_side = torch.empty(64, device="meta")  # 256 bytes off the host
    monkeypatch.setattr(_harness, "_device_room", lambda: 3 * 256)
    assert _harness._on_device(device_side, cuda=True)
    monkeypatch.setattr(_harness, "_device_room", lambda: 3 * 256 - 1)
    assert not _harness._on_device(device_side, cuda=True)
    assert _harness._on_device(torch.empty(8, device="meta"), cuda=True)  # small
    # The CPU path, and a host tensor a candidate returns on a GPU: a plain clone.
    assert _harness._on_device(device_side, cuda=False)
    assert _harness._on_device(torch.ones(64), cuda=True)


def test_an_output_with_no_room_for_its_clone_is_snapshot_as_block_sums(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_harness, "_EQUAL_BLOCK_BYTES", 64)
    monkeypatch.setattr(_harness, "_on_device", lambda t, cuda: False)
    out = torch.arange(100, dtype=torch.float32)  # 400 bytes: 7 blocks
    snap = _snapshot(out, cuda=True)
    assert isinstance(snap, _harness._Sums) and snap.sums.numel() == 7
    assert not _still_changing(out, snap)
    out[95] = -1.0  # a late write in the last block
    assert _still_changing(out, snap)
    odd = torch.ones(5, dtype=torch.bool)  # no multiple of 4 bytes: summed by bytes
    assert not _still_changing(odd, _snapshot(odd, cuda=True))
    assert not _still_changing(torch.tensor(2.5), _snapshot(torch.tensor(2.5), cuda=True))
    assert _snapshot(None, cuda=True) is None and not _still_changing(None, None)


def test_an_output_with_room_is_snapshot_as_a_clone() -> None:
    out = torch.ones(8)
    snap = _snapshot(out, cuda=False)
    assert snap is not out and not _still_changing(out, snap)
    out[0] = 2.0
    assert _still_changing(out, snap)


async def test_whole_takes_every_slot_and_two_takers_do_not_deadlock() -> None:
    lane = Lane(VerifierConfig(devices=[], candidates_per_gpu=2, prewarm=0), None)
    order: list[str] = []
    try:
        await lane.slots.acquire()  # a candidate in its GPU stage

        async def take(name: str) -> None:
            async with lane.whole():
                order.append(f"{name} in")
                assert lane.slots.locked() and lane.oracle_slots.locked()
                await asyncio.sleep(0.01)
                order.append(f"{name} out")

        await lane.oracle_slots.acquire()  # a problem being prepared
        takers = [asyncio.create_task(take("a")), asyncio.create_task(take("b"))]
        await asyncio.sleep(0.05)
        assert order == []  # both wait for the candidate's slot
        lane.slots.release()
        await asyncio.sleep(0.05)
        assert order == []  # and for the preparation
        lane.oracle_slots.release()
        await asyncio.wait_for(asyncio.gather(*takers), 5)
        assert order == ["a in", "a out", "b in", "b out"]
        assert not lane.slots.locked() and not lane.oracle_slots.locked()
        async with lane.slots, lane.slots:  # every slot is back
            pass
    finally:
        lane.close()


async def test_a_taker_cancelled_while_waiting_gives_back_what_it_took() -> None:
    lane = Lane(VerifierConfig(devices=[], candidates_per_gpu=2, prewarm=0), None)
    try:
        await lane.slots.acquire()

        async def take() -> None:
            async with lane.whole():
                pass

        taker = asyncio.create_task(take())
        await asyncio.sleep(0.05)  # it holds the free slot and waits for the other
        taker.cancel()
        with pytest.raises(asyncio.CancelledError):
            await taker
        lane.slots.release()
        async with lane.slots, lane.slots:
            pass
    finally:
        lane.close()


class _HostEvent:
    """A CUDA event's timing on the host, to run ``timed_calls``' bookkeeping here."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.t - self.t) * 1e3


def test_timing_holds_no_output_past_its_rotation_budget_and_stashes_kept_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_timing, "_Event", _HostEvent)
    monkeypatch.setattr(_timing, "_synchronize", lambda: None)
    monkeypatch.setattr(_timing, "_ROTATED_OUTPUT_BYTES", 100)
    alive: list[weakref.ref[torch.Tensor]] = []

    def call(args: Sequence[torch.Tensor]) -> torch.Tensor:
        assert all(r() is None for r in alive)  # no earlier output is held
        out = args[0] * 2  # 256 bytes, past the budget
        alive.append(weakref.ref(out))
        return out

    sets = [[torch.ones(64)], [torch.zeros(64)]]
    samples, kept = _timing.timed_calls(call, sets, 4, lambda: None, keep={1},
                                        stash=lambda out: ["stashed", out.sum().item()])
    assert len(samples.event_ms) == 4
    assert kept == {1: ["stashed", 0.0]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without CUDA")
def test_no_cuda_state_means_no_room() -> None:
    assert _harness._device_room() == 0
