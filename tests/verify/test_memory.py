"""Whose out-of-memory it was: the device's (others' memory: the verifier's, retried) or
the candidate's own (its process reached its memory cap)."""

from __future__ import annotations

import copy

import pytest
import torch

from kz_stream.testing.corpus.problems import PROBLEMS
from kz_stream.testing.corpus.triton_honest import TRITON_HONEST
from kz_stream.verify import Candidate, Problem, Status, Verdict, Verifier, VerifierConfig, _oracle
from kz_stream.verify._checks import device_was_full, problem_failure
from kz_stream.verify._reference import host_copy

# As the H200 worded it for a 6.4 GB ReLU while the verifier's other processes held the
# device (2026-11-30).
FULL = ("run on input set 0 (own): torch.OutOfMemoryError: CUDA out of memory. Tried to "
        "allocate 6.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 2.38 GiB is "
        "free. Including non-PyTorch memory, this process has 38.12 GiB memory in use.")
# The same request refused by the worker's own cap while the device still had room.
CAPPED = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 6.00 GiB. GPU 0 "
          "has a total capacity of 139.80 GiB of which 81.20 GiB is free. Including "
          "non-PyTorch memory, this process has 55.10 GiB memory in use.")


def test_a_full_device_is_not_the_candidates_fault() -> None:
    assert device_was_full(FULL)


def test_the_candidates_own_cap_is_its_fault() -> None:
    assert not device_was_full(CAPPED)
    assert not device_was_full("RuntimeError: boom")
    assert device_was_full(CAPPED.replace("81.20 GiB is", "512.00 MiB is"))


# A problem's preparation on the H200 (2026-12-01) while two generation processes beside
# the verifier held 126 GB of the device.
PREPARE_FULL = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 "
                "has a total capacity of 139.80 GiB of which 1.48 GiB is free. Process 556 "
                "has 64.80 GiB memory in use. Process 554 has 60.95 GiB memory in use.")


def test_a_preparation_on_a_full_device_is_an_infrastructure_failure() -> None:
    status, reason, check = problem_failure(PREPARE_FULL, "problem")
    assert (status, check) == (Status.INFRA_ERROR, "device_memory")
    assert "4.00 GiB" in reason
    status, reason, check = problem_failure("ValueError: shapes do not match", "problem")
    assert (status, check) == (Status.UNCHECKED, "problem")
    assert reason == "problem: ValueError: shapes do not match"


# The reference's timing worker of an 8 GiB sum in a KernelBench mix on an H100, beside
# other problems' workers (2026-12-06): it was ``unchecked``, a wrong verdict.
REFERENCE_FULL = ("reference timing worker: torch.OutOfMemoryError: CUDA out of memory. "
                  "Tried to allocate 8.00 GiB. GPU 0 has a total capacity of 79.18 GiB of "
                  "which 662.81 MiB is free.")


def test_a_reference_timing_on_a_full_device_is_an_infrastructure_failure() -> None:
    status, reason, check = problem_failure(REFERENCE_FULL, "reference timing")
    assert (status, check) == (Status.INFRA_ERROR, "device_memory")
    assert reason.startswith("reference timing: the device had no room")


# A problem whose preparation finds the device full: as the H100 worded it for an 8 GiB
# argmax prepared beside three candidates of 8 GiB problems (2026-12-06). The flag on the
# torch module lives as long as the oracle's process: ``once`` fails the first try alone.
def _filled_device_problem(*, once: bool) -> Problem:
    message = ("CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity "
               "of 79.18 GiB of which 7.15 GiB is free.")
    guard = "not getattr(torch, '_kz_test_device_full', False)" if once else "True"
    return Problem(PROBLEMS["relu"].replace(
        "def get_inputs():\n",
        f"def get_inputs():\n    if {guard}:\n        torch._kz_test_device_full = True\n"
        f"        raise torch.OutOfMemoryError({message!r})\n"))


def _verified(problem: Problem) -> Verdict:
    """An honest ReLU against ``problem``, by a verifier with one oracle (one process)."""
    v = Verifier(VerifierConfig(devices=[], prewarm=0, oracles=1))
    try:
        return v.verify_sync(problem, Candidate(TRITON_HONEST["relu"], "triton"))
    finally:
        v.close_sync()


def test_a_preparation_that_found_the_device_full_is_tried_again_with_the_device_to_itself(
) -> None:
    verdict = _verified(_filled_device_problem(once=True))
    assert verdict.status is Status.CORRECT, verdict.reason
    notes = verdict.details["problem_notes"]
    assert any("second try" in n and "7.15 GiB is free" in n for n in notes), notes


def test_a_device_full_on_both_tries_is_an_infrastructure_failure_that_says_so() -> None:
    verdict = _verified(_filled_device_problem(once=False))
    assert (verdict.status, verdict.check) == (Status.INFRA_ERROR, "device_memory")
    assert "second try too" in verdict.reason


def test_a_float64_copy_the_device_cannot_hold_is_made_and_run_on_the_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_room(model: torch.nn.Module) -> torch.nn.Module:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB")

    monkeypatch.setattr(_oracle, "float64_copy", no_room)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    x = torch.randn(5, 4)
    expected = copy.deepcopy(model).double()(x.double())
    notes: list[str] = []
    out = _oracle.Oracle("cuda")._outputs(model, [x], torch.float64, "own", notes)
    assert out[0].dtype == torch.float64 and torch.equal(out[0], expected)
    assert notes == ["own: float64 run on the host (the device could not hold it)"]
    assert model.get_parameter("0.weight").dtype == torch.float32  # left as it was


def test_a_host_copy_copies_each_tensor_once_and_keeps_tied_weights_tied() -> None:
    emb, head = torch.nn.Embedding(6, 4), torch.nn.Linear(4, 6, bias=False)
    head.weight = emb.weight  # tied, as a language model's head
    model = torch.nn.Sequential(emb, head, torch.nn.BatchNorm1d(6))
    host = host_copy(model, torch.float64)
    weight = host.get_parameter("0.weight")
    assert host.get_parameter("1.weight") is weight and weight.dtype == torch.float64
    assert weight.untyped_storage().data_ptr() != emb.weight.untyped_storage().data_ptr()
    assert torch.equal(weight, emb.weight.double())
    assert torch.equal(host.get_buffer("2.running_var"),
                       model.get_buffer("2.running_var").double())
    assert emb.weight.dtype == torch.float32
