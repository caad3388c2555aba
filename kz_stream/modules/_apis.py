"""Which PyTorch APIs a piece of Python source calls, found by AST with alias resolution.

One resolver serves both the catalog miner and module validation, so a requested API and
a called one are always spelled the same way. Names are canonical:

- layer classes: ``torch.nn.Conv2d`` (whatever the import alias or defining submodule);
- functions: ``torch.X`` when ``torch.X`` exists, so ``F.softmax``, ``x.softmax()`` and
  ``torch.softmax`` are one API; otherwise the resolved path (``torch.nn.functional.gelu``,
  ``torch.linalg.norm``); in-place variants (``relu_``) count as their op;
- tensor methods only where unambiguous: public methods of ``torch.Tensor`` that no builtin
  container, string, number or ``nn.Module`` also has (``x.softmax()`` counts, ``x.add()``
  could be a set's and does not); ``a @ b`` counts as ``torch.matmul``.

Plumbing (tensor creation, dtype/device moves, shape queries, module containers, init,
dropout) is not an API here. Neutral ops, layout (view, transpose, cat, ...) and the
elementwise arithmetic that operators call (add, mul, pow, ...), are reported separately:
validation accepts them anywhere, and the catalog leaves them out.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ARITHMETIC_OPS",
    "LAYOUT_OPS",
    "ApiUse",
    "canonical_api",
    "find_api_calls",
    "is_neutral",
    "tensor_methods",
]

# Not kernel work: creation, dtype/device, shape queries, autograd and module plumbing.
_PLUMBING_FUNCS = frozenset(
    """
    tensor as_tensor from_numpy zeros ones empty full arange linspace logspace eye
    zeros_like ones_like empty_like full_like rand randn randint rand_like randn_like
    randint_like randperm normal bernoulli multinomial manual_seed seed no_grad enable_grad
    set_grad_enabled inference_mode is_tensor is_floating_point is_complex numel finfo iinfo
    get_default_dtype set_default_dtype device dtype Size Generator compile autocast
    broadcast_shapes is_grad_enabled is_autocast_enabled get_autocast_dtype dropout
    alpha_dropout feature_alpha_dropout dropout1d dropout2d dropout3d is_nonzero
    result_type promote_types can_cast is_same_size is_storage set_printoptions
    """.split()
)
_PLUMBING_METHODS = frozenset(
    """
    size dim ndimension numel item tolist numpy to type type_as float half double int long
    bool short char byte bfloat16 cpu cuda detach detach_ requires_grad_ retain_grad
    backward data_ptr stride storage_offset is_contiguous element_size nelement
    new_zeros new_ones new_empty new_full new_tensor get_device is_floating_point
    is_complex is_signed untyped_storage pin_memory share_memory_ record_stream
    fill_ zero_ copy_ uniform_ normal_ random_ bernoulli_ exponential_ geometric_
    cauchy_ log_normal_ masked_fill_ set_ resize_ resize_as_ dtype device shape clone
    contiguous is_shared is_pinned is_set_to numel_ dim_order
    """.split()
)
_PLUMBING_PREFIXES = (
    "torch.nn.init.",
    "torch.nn.utils.",
    "torch.nn.parameter.",
    "torch.utils.",
    "torch.jit.",
    "torch.cuda.",
    "torch.backends.",
    "torch.distributed.",
    "torch.autograd.",
    "torch.fx.",
    "torch.compiler.",
    "torch._",
    "torch.testing.",
    "torch.hub.",
    "torch.onnx.",
    "torch.profiler.",
    "torch.library.",
    "torch.overrides.",
    "torch.amp.",
    "torch.cpu.",
    "torch.mps.",
    "torch.xpu.",
    "torch.random.",
    "torch.serialization.",
    "torch.types.",
)
_PLUMBING_LAYERS = frozenset(
    """
    Module ModuleList ModuleDict Sequential ParameterList ParameterDict Parameter Buffer
    Identity Dropout Dropout1d Dropout2d Dropout3d AlphaDropout FeatureAlphaDropout
    UninitializedParameter UninitializedBuffer
    """.split()
)

# Data movement without arithmetic: accepted anywhere, never counted as a requested API.
LAYOUT_OPS = frozenset(
    """
    view view_as reshape reshape_as permute transpose swapaxes swapdims t flatten unflatten
    unsqueeze squeeze expand expand_as repeat repeat_interleave tile split split_with_sizes
    chunk tensor_split unbind narrow select cat concat concatenate stack hstack vstack
    movedim moveaxis flip roll contiguous as_strided diagonal
    """.split()
)

# Elementwise arithmetic, what +, -, *, /, ** call: not an API of its own.
ARITHMETIC_OPS = frozenset(
    """
    add sub subtract mul multiply div divide true_divide floor_divide remainder neg
    negative rsub pow square reciprocal
    """.split()
)


def _builtin_method_names() -> frozenset[str]:
    names: set[str] = set()
    for t in (str, bytes, list, dict, set, frozenset, tuple, int, float, complex, object):
        names.update(dir(t))
    return frozenset(names)


@functools.cache
def _torch() -> Any:
    import torch

    return torch


@functools.cache
def tensor_methods() -> frozenset[str]:
    """Public ``torch.Tensor`` methods whose name alone identifies a tensor op."""
    import torch
    from torch import nn

    ambiguous = _builtin_method_names() | set(dir(nn.Module)) | _PLUMBING_METHODS
    return frozenset(
        n
        for n in dir(torch.Tensor)
        if not n.startswith("_") and n not in ambiguous and callable(getattr(torch.Tensor, n))
    )


def _lookup(dotted: str) -> object | None:
    obj: object = _torch()
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def is_neutral(api: str) -> bool:
    """True for a canonical API that any module may call: layout or arithmetic."""
    name = api.rsplit(".", 1)[-1]
    return name in LAYOUT_OPS or name in ARITHMETIC_OPS


@functools.cache
def canonical_api(dotted: str) -> str | None:
    """Returns the canonical name of a resolved ``torch...`` callable, or None for plumbing.

    ``dotted`` is a fully resolved path such as ``torch.nn.functional.relu`` or a tensor
    method written as ``torch.Tensor.relu``.
    """
    import inspect

    if not dotted.startswith("torch.") or dotted.startswith(_PLUMBING_PREFIXES):
        return None
    parts = dotted.split(".")
    name = parts[-1]
    obj = _lookup(dotted)
    if obj is None or not callable(obj):
        return None  # dtypes, constants, submodules
    if inspect.isclass(obj):
        from torch import nn

        if not issubclass(obj, nn.Module):
            return None  # dtypes, Size, Generator, ...
        if obj.__name__ in _PLUMBING_LAYERS:
            return None
        if getattr(nn, obj.__name__, None) is obj:
            return f"torch.nn.{obj.__name__}"
        return dotted
    if name in _PLUMBING_FUNCS or (parts[1] == "Tensor" and name in _PLUMBING_METHODS):
        return None
    torch = _torch()
    # In-place variants (relu_, add_) are the same op as far as a kernel is concerned.
    if name.endswith("_") and not name.endswith("__") and len(name) > 1:
        base = name[:-1]
        if callable(getattr(torch, base, None)) or callable(getattr(torch.Tensor, base, None)):
            name = base
            dotted = ".".join([*parts[:-1], base])
    top = getattr(torch, name, None)
    if callable(top) and not inspect.isclass(top) and not inspect.ismodule(top):
        return f"torch.{name}"
    if parts[1] == "Tensor":
        return f"torch.Tensor.{name}"
    return dotted


@dataclass
class ApiUse:
    """What a source calls: canonical APIs and neutral ops, each in first-call order."""

    apis: list[str] = field(default_factory=list)
    neutral: list[str] = field(default_factory=list)

    def add(self, api: str) -> None:
        target = self.neutral if is_neutral(api) else self.apis
        if api not in target:
            target.append(api)


class _Aliases:
    """Import aliases in scope: local name -> dotted module or object path."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def visit_import(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    self.names[a.asname] = a.name
                else:  # `import torch.nn` binds `torch`
                    root = a.name.split(".")[0]
                    self.names[root] = root
        elif node.module and node.level == 0:
            for a in node.names:
                if a.name != "*":
                    self.names[a.asname or a.name] = f"{node.module}.{a.name}"

    def resolve(self, expr: ast.expr) -> str | None:
        """Dotted path of a Name/Attribute chain rooted at an import alias, else None."""
        parts: list[str] = []
        while isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name) or expr.id not in self.names:
            return None
        return ".".join([self.names[expr.id], *reversed(parts)])


def _collect_aliases(tree: ast.AST) -> _Aliases:
    aliases = _Aliases()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            aliases.visit_import(node)
    # `ACT = nn.GELU` style module-level rebinding of a resolved path.
    if isinstance(tree, ast.Module):
        for stmt in tree.body:
            if (
                isinstance(stmt, ast.Assign)
                and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)
                and isinstance(stmt.value, ast.Attribute | ast.Name)
            ):
                path = aliases.resolve(stmt.value)
                if path and path.startswith("torch"):
                    aliases.names[stmt.targets[0].id] = path
    return aliases


def find_api_calls(
    source_or_tree: str | ast.AST,
    *,
    nodes: Iterable[ast.AST] | None = None,
    aliases: _Aliases | None = None,
) -> ApiUse:
    """Returns the canonical torch APIs called in ``nodes`` (default: the whole tree).

    Imports are read from the whole tree, so a class can be analysed on its own while its
    module's ``import torch.nn.functional as F`` still applies.
    """
    tree = ast.parse(source_or_tree) if isinstance(source_or_tree, str) else source_or_tree
    aliases = aliases or _collect_aliases(tree)
    methods = tensor_methods()
    use = ApiUse()
    for root in nodes if nodes is not None else [tree]:
        for node in ast.walk(root):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
                use.add("torch.matmul")
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            path = aliases.resolve(func)
            if path is not None:
                api = canonical_api(path) if path.startswith("torch.") else None
            elif isinstance(func, ast.Attribute) and func.attr in methods:
                # A method call on something that is not an imported module: a tensor
                # method when the name is unambiguous. `self.x()` is the module's own.
                base = func.value
                if isinstance(base, ast.Name) and base.id == "self":
                    continue
                if isinstance(base, ast.Call) and isinstance(base.func, ast.Name):
                    if base.func.id == "super":
                        continue
                api = canonical_api(f"torch.Tensor.{func.attr}")
            else:
                api = None
            if api is not None:
                use.add(api)
    return use
