import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    """Mean hinge loss; the +-1 labels broadcast along the last dim."""

    def forward(self, predictions, targets):
        return torch.clamp(1 - predictions * targets, min=0).mean()


batch = 32768
dim = 32768


def get_inputs():
    labels = torch.randint(0, 2, (dim,)).float() * 2 - 1
    return [torch.rand(batch, dim), labels]


def get_init_inputs():
    return []
