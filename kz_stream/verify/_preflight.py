"""A Triton candidate's first look, before its problem is prepared.

Preparing a problem at KernelBench's sizes (the float64 oracle on every input set) takes up
to minutes on an H200, and a weak policy's kernels mostly fail long before they would need
it: a name that is not defined, a constructor called with the wrong arguments, no
``forward``. The preflight imports the candidate and builds ``ModelNew`` on the meta device
(no memory, no kernel) in a sandboxed child on the CPU, with the arguments the reference's
``get_init_inputs()`` gives (computed in a child of its own: the candidate never sees the
reference). Only errors that cannot depend on the device or the data decide a verdict
(``DECISIVE``): the same ``runtime_error`` the GPU stage would give, without the
preparation. Anything else, a timeout or a sandbox failure included, lets the candidate go
on to the full verification.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kz_stream.verify._reference import ReferenceModule

__all__ = [
    "IMPORTS",
    "Finding",
    "candidate_preflight",
    "module_footprint",
    "reference_facts",
]

# What this module's functions import: the children that run them import these before
# their call arrives (``run_in_sandbox(preload=IMPORTS)``).
IMPORTS = ("torch", "kz_stream.verify._compare", "kz_stream.verify._inputs",
           "kz_stream.verify._ipc", "kz_stream.verify._loader", "kz_stream.verify._reference")

# (stage, "Type: message") of a decisive failure, or None.
Finding = tuple[str, str] | None

# What a TypeError says when a constructor is called with arguments that do not fit it.
_SIGNATURE = re.compile(r"__init__\(\) (missing \d+ required|takes \d+ positional|takes from "
                        r"\d+ to \d+ positional|got an unexpected keyword|got multiple values)")


def module_footprint(ref: ReferenceModule) -> tuple[int, int | None, int]:
    """Bytes of a reference's own inputs, of what a set keeps of its outputs on them
    (None where the forward cannot run on the meta device) and of its model's weights
    (parameters and buffers; 0 where it cannot be built there), found on the meta device:
    no memory, no kernel. What a preparation will hold, before it runs. A set keeps each
    output twice (``Oracle._one_set``): as the reference returns it and as its float64
    run does, which is 8 bytes an element for a floating output (a float16 one grows
    fivefold, a float32 one threefold) and the same dtype otherwise (an argmax's int64, a
    mask's bool)."""
    import torch

    from kz_stream.verify._compare import flatten

    def size(values: list[Any]) -> int:
        # Meta tensors have no storage to tell shared ones apart: count each view.
        return sum(v.numel() * v.element_size() for v in values
                   if isinstance(v, torch.Tensor))

    def kept(values: list[Any]) -> int:  # honest and float64 outputs
        return sum(v.numel() * (v.element_size() + (8 if v.is_floating_point()
                                                    else v.element_size()))
                   for v in values if isinstance(v, torch.Tensor))

    with torch.device("meta"):
        inputs = list(ref.get_inputs())
        init = list(ref.get_init_inputs())
        try:
            model = ref.model_cls(*init)
            weights = size(list(model.state_dict().values()))
        except Exception:
            return size(inputs), None, 0
        try:
            with torch.no_grad():
                out = flatten(model(*inputs))
        except Exception:
            return size(inputs), None, weights
    return size(inputs), kept(out), weights


def reference_facts(source: str) -> tuple[list[Any], int, int | None, int, float]:
    """The reference's ``get_init_inputs()``, the bytes of its
    inputs, outputs and weights (``module_footprint``) and the largest share of them a set
    at an eighth of the shapes keeps (``small_set_share``): what the preflight and the
    host's memory budget need to know of a problem, from one sandboxed child (run in
    one)."""
    import torch

    from kz_stream.verify._inputs import small_set_share
    from kz_stream.verify._reference import load_reference

    ref = load_reference(source, os.getcwd())
    init = list(ref.get_init_inputs())
    try:
        with torch.device("meta"):
            share = small_set_share(list(ref.get_inputs()))
    except Exception:  # a generator the meta device cannot run
        share = 1.0
    return (init, *module_footprint(ref), share)


def _decisive_at_load(e: BaseException) -> bool:
    if isinstance(e, (NameError, ImportError, SyntaxError)):
        return True
    # ``tl.log_density``: a module attribute that does not exist, whatever the device.
    return isinstance(e, AttributeError) and str(e).startswith("module ")


def _decisive_at_construct(e: BaseException) -> bool:
    if isinstance(e, NameError):
        return True
    return isinstance(e, TypeError) and bool(_SIGNATURE.search(str(e)))


def candidate_preflight(source: str, init_args: list[Any]) -> Finding:
    """Imports ``source`` and builds ``ModelNew(*init_args)`` on the meta device; returns the
    stage ("load", "construct", "run") and error of a decisive failure, or None (run in a
    sandboxed child)."""
    import torch

    from kz_stream.verify._ipc import error_text
    from kz_stream.verify._loader import InterfaceError, load_source, require

    try:
        module = load_source(source, "kz_candidate", os.getcwd())
        (model_cls,) = require(module, "ModelNew")
    except InterfaceError as e:
        return "load", error_text(e)
    except Exception as e:
        return ("load", error_text(e)) if _decisive_at_load(e) else None
    try:
        with torch.device("meta"):
            model = model_cls(*init_args)
    except Exception as e:
        return ("construct", error_text(e)) if _decisive_at_construct(e) else None
    if not isinstance(model, torch.nn.Module):
        return "construct", "TypeError: ModelNew(...) is not a torch.nn.Module"
    if type(model).forward is torch.nn.Module.forward:
        return "run", ('NotImplementedError: Module [ModelNew] is missing the required '
                       '"forward" function')
    return None
