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
from kz_stream.verify._harness import _on_host, _pristine, _snapshot, bits_equal
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
    monkeypatch.setattr(_harness, "_CLONE_MAX_BYTES", 100)
    sent = torch.ones(64)  # 256 bytes
    arg = sent.clone()  # stands in for its copy on the device
    assert _pristine(arg, sent, cuda=True) is sent
    small = torch.ones(8)
    kept = _pristine(small, small, cuda=True)
    assert kept is not small and torch.equal(kept, small)
    # On the CPU path the argument may be the host tensor itself: always a clone.
    assert _pristine(sent, sent, cuda=False) is not sent
    assert _pristine(3, 3, cuda=True) == 3


async def test_whole_takes_every_slot_and_two_takers_do_not_deadlock() -> None:
    lane = Lane(VerifierConfig(devices=[], candidates_per_gpu=2, prewarm=0), None)
    order: list[str] = []
    try:
        await lane.slots.acquire()  # a candidate in its GPU stage

        async def take(name: str) -> None:
            async with lane.whole():
                order.append(f"{name} in")
                assert lane.slots.locked()
                await asyncio.sleep(0.01)
                order.append(f"{name} out")

        takers = [asyncio.create_task(take("a")), asyncio.create_task(take("b"))]
        await asyncio.sleep(0.05)
        assert order == []  # both wait for the candidate's slot
        lane.slots.release()
        await asyncio.wait_for(asyncio.gather(*takers), 5)
        assert order == ["a in", "a out", "b in", "b out"]
        assert not lane.slots.locked()
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


def test_a_big_output_is_snapshot_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_harness, "_CLONE_MAX_BYTES", 100)
    small, big = torch.ones(8), torch.ones(64)
    assert _snapshot(small, cuda=True) is not small
    assert _snapshot(big, cuda=True).device.type == "cpu"
    assert _snapshot(big, cuda=False) is not big  # the CPU path: a clone
    assert _snapshot(None, cuda=True) is None
    assert not _on_host(_snapshot(big, cuda=False), big)  # not a device output


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


def test_a_big_tensor_is_copied_on_the_device_where_three_times_it_fits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_harness, "_CLONE_MAX_BYTES", 100)
    sent = torch.ones(64)  # 256 bytes
    monkeypatch.setattr(_harness, "_device_room", lambda: 3 * 256)
    assert _pristine(sent.clone(), sent, cuda=True) is not sent
    assert _snapshot(sent, cuda=True) is not sent
    monkeypatch.setattr(_harness, "_device_room", lambda: 3 * 256 - 1)
    assert _pristine(sent.clone(), sent, cuda=True) is sent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without CUDA")
def test_no_cuda_state_means_no_room() -> None:
    assert _harness._device_room() == 0
