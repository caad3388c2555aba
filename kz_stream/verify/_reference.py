"""Evaluating a reference module: loading it, building it with fixed random weights, and
running it in float64 (the expected output) and in its own precision (the honest
implementation the tolerances are calibrated on)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kz_stream.verify._compare import flatten
from kz_stream.verify._inputs import to_device
from kz_stream.verify._loader import load_source, require


@dataclass
class ReferenceModule:
    """The three names a KernelBench module defines."""

    model_cls: type[nn.Module]
    get_inputs: Callable[[], Sequence[Any]]
    get_init_inputs: Callable[[], Sequence[Any]]


def load_reference(source: str, directory: str | None = None) -> ReferenceModule:
    """Imports the reference source; raises InterfaceError if a name is missing."""
    module = load_source(source, "kz_reference", directory)
    model_cls, get_inputs, get_init_inputs = require(
        module, "Model", "get_inputs", "get_init_inputs"
    )
    return ReferenceModule(model_cls, get_inputs, get_init_inputs)


def strict_precision() -> None:
    """Turns off TF32 and reduced-precision reductions so that float32 means float32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.set_float32_matmul_precision("highest")


def perturb_(model: nn.Module, seed: int) -> None:
    """Adds seeded noise to every floating parameter, so that default initialisations
    (LayerNorm's ones and zeros) do not let a candidate ignore its weights."""
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


def build_model(
    ref: ReferenceModule, init_args: Sequence[Any], weight_seed: int, device: str
) -> nn.Module:
    """Builds ``Model(*init_args)`` under ``weight_seed`` with perturbed weights, in eval-free
    default (training) mode as KernelBench runs it."""
    torch.manual_seed(weight_seed)
    model = ref.model_cls(*init_args)
    perturb_(model, weight_seed + 7919)
    return model.to(device)


def float64_copy(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model`` (floating parameters and buffers upcast)."""
    return copy.deepcopy(model).to(torch.float64)


def run(model: nn.Module, inputs: Sequence[Any], device: str,
        dtype: torch.dtype | None = None) -> list[Any]:
    """Calls the model without autograd; floating inputs are cast to ``dtype`` if given."""
    args = to_device(inputs, device, dtype)
    with torch.no_grad():
        out = model(*args)
    return [o.detach() if isinstance(o, torch.Tensor) else o for o in flatten(out)]
