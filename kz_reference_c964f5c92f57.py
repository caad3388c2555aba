import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    """Triplet margin loss (Euclidean distances), averaged."""

    def __init__(self, margin):
        super().__init__()
        self.loss = nn.TripletMarginLoss(margin=margin)

    def forward(self, anchor, positive, negative):
        return self.loss(anchor, positive, negative)


batch = 32768
dim = 8192


def get_inputs():
    s = torch.rand(())
    return [torch.rand(batch, dim) * s, torch.rand(batch, dim), torch.rand(batch, dim)]


def get_init_inputs():
    return [1.0]
