import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    """Cross-entropy of logits against class indices, averaged."""

    def forward(self, logits, labels):
        return F.cross_entropy(logits, labels)


batch = 32768
classes = 4096


def get_inputs():
    return [torch.rand(batch, classes), torch.randint(0, classes, (batch,))]


def get_init_inputs():
    return []
