"""``perturb_`` as first written (verifier kzv-1.x): the weights every verdict so far rests
on, kept as the specification the faster ``kz_stream.verify._reference.perturb_`` must
equal bit for bit (tests) and as its baseline (``benchmarks/bench_build_model.py``)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["perturb_first_form"]


def perturb_first_form(model: nn.Module, seed: int) -> None:
    """Adds seeded noise to every floating parameter, one float64 copy per expression."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.dtype.is_floating_point or p.numel() == 0:
                continue
            base = p.detach().to("cpu", torch.float64)
            spread = float(base.std()) if base.numel() > 1 else 0.0
            spread = max(spread, 0.1 * float(base.abs().mean()), 0.05)
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64) * spread * 0.5
            p.add_(noise.to(device=p.device, dtype=p.dtype))
