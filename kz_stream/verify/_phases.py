"""Where a preparation's time goes: seconds per named phase."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimer:
    """Sums the seconds spent in each named phase. On a GPU the device is synchronised at
    each phase's end, so its work counts in the phase that issued it."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.seconds: defaultdict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t = time.monotonic()
        try:
            yield
            if self.device != "cpu":  # not after an error: a CUDA error would replace it
                import torch

                torch.cuda.synchronize()
        finally:
            self.seconds[name] += time.monotonic() - t

    def rounded(self) -> dict[str, float]:
        """The phases' seconds to the millisecond."""
        return {k: round(v, 3) for k, v in self.seconds.items()}
