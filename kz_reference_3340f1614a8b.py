import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    """Applies one activation elementwise."""

    def forward(self, x):
        return F.softplus(x)


rows = 4096
cols = 393216


def get_inputs():
    return [torch.rand(rows, cols)]


def get_init_inputs():
    return []
