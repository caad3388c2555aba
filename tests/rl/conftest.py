"""Shared fixtures of the RL tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # The models here are small: one thread avoids contention on a shared 2-core machine
    # (measured: the learning test took 167 s with the default threads under load, 5 s
    # with one) and keeps float reductions in one order.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
