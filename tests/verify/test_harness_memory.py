"""The worker's per-call checks hold little device memory beside the candidate's own: an
honest kernel of an 8 GiB KernelBench input must fit a worker's allowance on an H100."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from kz_stream.verify import VerifierConfig, _harness, _timing
from kz_stream.verify._harness import (
    _differs,
    _pristine,
    _set_args,
    _snapshot,
    bits_equal,
    block_sums,
)
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


def test_a_big_device_input_is_checked_against_its_block_sums(
        monkeypatch: pytest.MonkeyPatch) -> None:
    arg = torch.ones(64)  # stands in for a set on the device
    monkeypatch.setattr(_harness, "_input_cloned", lambda t, cuda: False)
    sums = _pristine(arg, cuda=True)
    assert isinstance(sums, _harness._Sums) and not _differs(arg, sums)
    arg[7] = 2.0
    assert _differs(arg, sums)
    monkeypatch.setattr(_harness, "_input_cloned", lambda t, cuda: True)
    kept = _pristine(arg, cuda=True)
    assert kept is not arg and torch.equal(kept, arg)
    assert _pristine(3, cuda=True) == 3


def test_block_sums_see_a_swap_and_a_change_that_keeps_the_plain_sum(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_harness, "_SUM_BLOCK_BYTES", 64)
    t = torch.arange(40, dtype=torch.int32)
    sums = block_sums(t)
    assert sums.dtype == torch.int64 and sums.numel() == 2 * 3  # 160 bytes: 3 blocks
    swapped = t.clone()
    swapped[[3, 5]] = swapped[[5, 3]]  # a sort would do this
    moved = t.clone()
    moved[3] += 1
    moved[5] -= 1
    for changed in (swapped, moved):
        assert block_sums(changed)[0] == sums[0]  # the plain sum of the block is kept
        assert not torch.equal(block_sums(changed), sums)
    big = torch.full((8,), 2**31 - 1, dtype=torch.int32)  # sums past int32 stay exact
    assert int(block_sums(big)[0]) == 8 * (2**31 - 1)


def test_set_0_is_uploaded_once_and_handed_out_again_while_unwritten() -> None:
    state = _harness.State("cpu")
    # Each request brings its own copy of the set, as a worker's request does.
    first = _set_args(state, [torch.arange(8.0), 3], 0)
    assert _set_args(state, [torch.arange(8.0), 3], 0) is first
    other = [torch.ones(8)]
    assert _set_args(state, other, 1)[0] is other[0]  # not kept: as it came
    assert state.kept is not None and state.kept.args is first
    assert _set_args(state, [torch.arange(8.0), 3], 0) is first
    first[0][2] = -1.0  # a call wrote into it
    fresh: list[Any] = [torch.arange(8.0), 3]
    again = _set_args(state, fresh, 0)
    assert again is not first and torch.equal(again[0], torch.arange(8.0))
    assert _set_args(state, [torch.arange(8.0), 3], 0) is again  # kept afresh
    assert _set_args(state, [torch.zeros(2)], None) is not again  # a set with no index


def test_the_kept_set_makes_room_for_another_set_that_would_not_fit_beside_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    state = _harness.State("cpu")
    state.cuda = True  # a GPU worker's bookkeeping, on the host
    monkeypatch.setattr(_harness, "_device_room", lambda: 3 * 256)
    kept = _set_args(state, [torch.ones(64)], 0)
    _set_args(state, [torch.ones(64)], 1)  # 256 bytes: three times it fits
    assert state.kept is not None and state.kept.args is kept
    _set_args(state, [torch.ones(65)], 1)
    assert state.kept is None


def test_an_ablation_call_never_sees_set_0_as_an_earlier_call_left_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # An upload is a copy (host to device); on the host, a clone stands for it.
    monkeypatch.setattr(_harness, "to_device", lambda values, device: [
        v.clone() if isinstance(v, torch.Tensor) else v for v in values])
    seen: list[float] = []

    class WritesItsInput(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(float(x[0]))
            x[0] = 99.0
            return x * 2

    state = _harness.State("cpu")
    state.models["own"] = WritesItsInput()
    _set_args(state, [torch.ones(4)], 0)  # kept by an earlier request
    reply = _harness._ablate(state, {"cmd": "ablate", "kernels": ["k1", "k2", "k3"],
                                     "inputs": [torch.ones(4)], "set": 0, "out_specs": [],
                                     "model": "own", "other_inputs": None})
    assert seen == [1.0, 1.0, 1.0]  # each written copy was replaced by a fresh one
    assert set(reply["outputs"]) == {"k1", "k2", "k3"}


def test_an_outputs_snapshot_is_a_device_copy_where_three_times_it_fits(
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


def test_an_input_is_cloned_for_the_checks_up_to_a_gibibyte_however_free_the_device_is(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_harness, "_CLONE_MAX_BYTES", 100)
    monkeypatch.setattr(_harness, "_device_room", lambda: 1 << 40)  # all the room there is
    assert not _harness._input_cloned(torch.empty(64, device="meta"), cuda=True)  # 256 B
    assert _harness._input_cloned(torch.empty(25, device="meta"), cuda=True)  # 100 B
    # The CPU path, and a host tensor: a plain clone.
    assert _harness._input_cloned(torch.empty(64, device="meta"), cuda=False)
    assert _harness._input_cloned(torch.ones(64), cuda=True)


def test_an_output_with_no_room_for_its_clone_is_snapshot_as_block_sums(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_harness, "_SUM_BLOCK_BYTES", 64)
    monkeypatch.setattr(_harness, "_on_device", lambda t, cuda: False)
    out = torch.arange(100, dtype=torch.float32)  # 400 bytes: 7 blocks, two sums each
    snap = _snapshot(out, cuda=True)
    assert isinstance(snap, _harness._Sums) and snap.sums.numel() == 14
    assert not _differs(out, snap)
    out[95] = -1.0  # a late write in the last block
    assert _differs(out, snap)
    odd = torch.ones(5, dtype=torch.bool)  # no multiple of 4 bytes: summed by bytes
    assert not _differs(odd, _snapshot(odd, cuda=True))
    assert not _differs(torch.tensor(2.5), _snapshot(torch.tensor(2.5), cuda=True))
    assert _snapshot(None, cuda=True) is None and not _differs(None, None)


def test_an_output_with_room_is_snapshot_as_a_clone() -> None:
    out = torch.ones(8)
    snap = _snapshot(out, cuda=False)
    assert snap is not out and not _differs(out, snap)
    out[0] = 2.0
    assert _differs(out, snap)


async def test_alone_waits_for_the_room_and_two_takers_do_not_deadlock() -> None:
    lane = Lane(VerifierConfig(devices=[], candidates_per_gpu=2, prewarm=0), None)
    order: list[str] = []
    try:
        candidate = asyncio.Event()

        async def hold(name: str, until: asyncio.Event) -> None:
            async with lane.room_for(0):  # the CPU path's stages hold no device bytes
                order.append(name)
                await until.wait()

        running = asyncio.create_task(hold("running", candidate))  # a candidate's stage
        await asyncio.sleep(0.01)

        async def take(name: str) -> None:
            async with lane.alone():
                order.append(f"{name} in")
                assert lane.room.held > lane.room.limit
                await asyncio.sleep(0.01)
                order.append(f"{name} out")

        takers = [asyncio.create_task(take("a")), asyncio.create_task(take("b"))]
        await asyncio.sleep(0.05)
        later = asyncio.create_task(hold("later", asyncio.Event()))  # queued after them
        await asyncio.sleep(0.05)
        assert order == ["running"]  # both wait for the stage that runs
        candidate.set()
        await asyncio.wait_for(asyncio.gather(*takers), 5)
        await asyncio.sleep(0.01)
        # Then the stage queued behind them.
        assert order == ["running", "a in", "a out", "b in", "b out", "later"]
        later.cancel()
        await asyncio.gather(running, later, return_exceptions=True)
        assert lane.room.held == 0 and lane.room.holders == 0
    finally:
        lane.close()


async def test_a_taker_cancelled_while_waiting_gives_back_what_it_took() -> None:
    lane = Lane(VerifierConfig(devices=[], candidates_per_gpu=2, prewarm=0), None)
    try:
        await lane.room.acquire(1)

        async def take() -> None:
            async with lane.alone():
                pass

        taker = asyncio.create_task(take())
        await asyncio.sleep(0.05)  # it waits for the holder
        taker.cancel()
        with pytest.raises(asyncio.CancelledError):
            await taker
        lane.room.release(1)
        assert lane.room.held == 0 and lane.room.holders == 0
        async with lane.alone():  # nothing was left behind
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


@pytest.mark.gpu
def test_on_a_gpu_set_0_is_uploaded_once_and_again_after_a_write() -> None:
    state = _harness.State("cuda")
    host = [torch.randn(1 << 20), 2]
    first = _set_args(state, host, 0)
    assert first[0].is_cuda and torch.equal(first[0].cpu(), host[0])
    assert _set_args(state, [host[0].clone(), 2], 0) is first
    first[0][-1] += 1.0  # a call wrote into the device copy
    again = _set_args(state, [host[0].clone(), 2], 0)
    assert again is not first and torch.equal(again[0].cpu(), host[0])


def test_a_run_on_the_kept_set_takes_its_sums_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_harness, "_on_device", lambda t, cuda: False)  # no room to clone
    monkeypatch.setattr(_harness, "_input_cloned", lambda t, cuda: False)  # past a GiB
    summed: list[int] = []
    real = _harness.block_sums

    def counted(t: torch.Tensor) -> torch.Tensor:
        summed.append(t.untyped_storage().data_ptr())
        return real(t)

    monkeypatch.setattr(_harness, "block_sums", counted)
    state = _harness.State("cpu")
    state.models["own"] = torch.nn.ReLU()
    x = torch.randn(64)
    reply = _harness._run(state, {"cmd": "run", "inputs": [x], "set": 0, "out_specs": [],
                                  "model": "own", "reps": 2})
    assert "input_mutation" not in reply["flags"]
    kept = state.kept.args[0].untyped_storage().data_ptr() if state.kept else None
    # Taken at the upload, then read after each of the two calls: three passes, not four.
    assert summed.count(kept) == 3, summed


def test_a_big_output_is_replied_in_a_sealed_file_up_to_the_workers_file_cap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kz_stream.verify import _harness, _ipc

    big = torch.arange(float(5 << 20))  # 20 MiB: past the 16 MiB from which files pay
    sent = _harness._reply_value(big)
    assert torch.equal(sent, big) and _ipc._shared_file(sent) is not None
    monkeypatch.setattr(_harness, "WORKER_FILE_BYTES", 16 << 20)  # past the cap: no file
    past = _harness._reply_value(big)
    assert torch.equal(past, big) and _ipc._shared_file(past) is None
    small = torch.ones(8)
    assert _ipc._shared_file(_harness._reply_value(small)) is None
    assert _harness._reply_value(3) == 3
