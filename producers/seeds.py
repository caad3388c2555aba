"""Hand-written modules that open a run (a warm start): the small embedded model rarely
writes a valid module at first, and the Coder needs problems from the first minute.
Written for this project; each is small enough to verify quickly on the CPU."""

from __future__ import annotations

from kz_stream.producers.proposer import SeedModule

__all__ = ["SEED_MODULES", "synthesized_seeds"]

_SIGMOID_MUL = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    """Gated activation: x * sigmoid(y)."""

    def __init__(self):
        super().__init__()

    def forward(self, x, y):
        return torch.mul(x, torch.sigmoid(y))


def get_inputs():
    return [torch.randn(64, 256), torch.randn(64, 256)]


def get_init_inputs():
    return []
'''

_TANH_SUM = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    """Row sums of tanh(x)."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.sum(torch.tanh(x), dim=1)


def get_inputs():
    return [torch.randn(128, 512)]


def get_init_inputs():
    return []
'''

_MATMUL_RELU = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    """relu(a @ b)."""

    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return torch.relu(torch.matmul(a, b))


def get_inputs():
    return [torch.randn(64, 128), torch.randn(128, 96)]


def get_init_inputs():
    return []
'''

_SOFTMAX_SCALE = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    """Softmax over the last dimension of a scaled input."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return torch.softmax(torch.mul(x, self.scale), dim=-1)


def get_inputs():
    return [torch.randn(32, 384)]


def get_init_inputs():
    return [0.5]
'''

SEED_MODULES: tuple[SeedModule, ...] = (
    SeedModule(("torch.mul", "torch.sigmoid"), _SIGMOID_MUL),
    SeedModule(("torch.sum", "torch.tanh"), _TANH_SUM),
    SeedModule(("torch.matmul", "torch.relu"), _MATMUL_RELU),
    SeedModule(("torch.mul", "torch.softmax"), _SOFTMAX_SCALE),
)


def synthesized_seeds(count: int, *, seed: int = 1000) -> tuple[SeedModule, ...]:
    """``count`` modules from the warm start's synthesizer (a supply in the form the warm
    Coder was trained on, while the Proposer is weak); a seed apart from the SFT data's."""
    from kz_stream.warmstart.synth import Synthesizer

    return tuple(SeedModule(m.api_set, m.source)
                 for m in Synthesizer(seed=seed).modules(count)) if count > 0 else ()
