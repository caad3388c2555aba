"""Whose out-of-memory it was: the device's (others' memory: the verifier's, retried) or
the candidate's own (its process reached its memory cap)."""

from __future__ import annotations

from kz_stream.verify import Status
from kz_stream.verify._checks import device_was_full
from kz_stream.verify._verifier import preparation_failure

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
    status, reason, check = preparation_failure(PREPARE_FULL)
    assert (status, check) == (Status.INFRA_ERROR, "device_memory")
    assert "4.00 GiB" in reason
    status, reason, check = preparation_failure("ValueError: shapes do not match")
    assert (status, check) == (Status.UNCHECKED, "problem")
    assert reason == "problem: ValueError: shapes do not match"
