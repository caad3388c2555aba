import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    """Layer norm over the last three dims, with its affine weights."""

    def __init__(self, shape):
        super().__init__()
        self.ln = nn.LayerNorm(shape)

    def forward(self, x):
        return self.ln(x)


batch = 16
features = 64
d1 = 256
d2 = 256


def get_inputs():
    return [torch.rand(batch, features, d1, d2)]


def get_init_inputs():
    return [(features, d1, d2)]
