import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    """Applies one activation elementwise."""

    def __init__(self, slope):
        super().__init__()
        self.slope = slope

    def forward(self, x):
        return F.leaky_relu(x, self.slope)


rows = 4096
cols = 393216


def get_inputs():
    return [torch.rand(rows, cols)]


def get_init_inputs():
    return [0.01]
