import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    """Mean squared error over every element."""

    def forward(self, predictions, targets):
        return ((predictions - targets) ** 2).mean()


batch = 32768
dim = 32768


def get_inputs():
    s = torch.rand(())
    return [torch.rand(batch, dim) * s, torch.rand(batch, dim)]


def get_init_inputs():
    return []
