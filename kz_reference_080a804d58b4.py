import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    """Linear layer, times a constant, then leaky ReLU."""

    def __init__(self, in_features, out_features, multiplier, slope):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.multiplier = multiplier
        self.slope = slope

    def forward(self, x):
        return F.leaky_relu(self.gemm(x) * self.multiplier, self.slope)


batch = 1024
in_features = 8192
out_features = 8192


def get_inputs():
    return [torch.rand(batch, in_features)]


def get_init_inputs():
    return [in_features, out_features, 2.0, 0.1]
