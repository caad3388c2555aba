"""The operations the module synthesizer composes and the Triton teacher lowers.

Each ``Op`` is one canonical API (as ``kz_stream.modules.canonical_api`` names it) with two faces:
the PyTorch line a ``Model`` calls it with, and the Triton code that computes the same
thing inside a kernel. Keeping both in one record is what makes every synthesized module
come with a teacher kernel: the two cannot drift apart.

Kinds, in the order a module applies them:

- ``matmul``: ``x [M, K] -> [M, N]`` (at most one, always first);
- ``unary`` and ``binary``: elementwise on the running tensor (``binary`` reads a second
  input of the same shape);
- ``rowmap``: a whole-row operation along the last dimension (softmax, norms, cumsum);
- ``reduce``: a row reduction along the last dimension, ``[..., N] -> [...]`` (at most
  one, always last but for elementwise ops after it).

Triton snippets use ``x`` for the running tile, ``{y}`` for a binary op's second input,
``mask`` for valid lanes, ``n_cols`` for the row length and ``{p}`` for this op's
parameter-pointer prefix. Domains are kept safe in the PyTorch line itself (``log`` of
``x * x + 1``), so every input set the verifier draws is valid for the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["OPS", "Op", "OpKind", "ops_by_api"]

OpKind = Literal["matmul", "unary", "binary", "rowmap", "reduce"]


@dataclass(frozen=True)
class Op:
    """One API with its PyTorch call and its Triton lowering."""

    api: str
    kind: OpKind
    torch: str  # the expression, with {x} (and {y}, {m} for the module attribute)
    triton: str  # statements (rowmap/reduce) or an expression (unary/binary) over x
    module: str | None = None  # the nn module constructor, with {n} for the row length
    params: tuple[str, ...] = ()  # attributes of the nn module the kernel reads


def _u(api: str, torch: str, triton: str, module: str | None = None) -> Op:
    return Op(api, "unary", torch, triton, module=module)


# Row operations: ``x`` is one row (masked lanes hold 0.0 on entry), the result is the row.
_SOFTMAX = """\
x_max = tl.max(tl.where(mask, x, -float("inf")), axis=0)
x_exp = tl.where(mask, tl.exp(x - x_max), 0.0)
x = x_exp / tl.sum(x_exp, axis=0)"""
_LOG_SOFTMAX = """\
x_max = tl.max(tl.where(mask, x, -float("inf")), axis=0)
x_exp = tl.where(mask, tl.exp(x - x_max), 0.0)
x = x - x_max - tl.log(tl.sum(x_exp, axis=0))"""
_LAYER_NORM = """\
mean = tl.sum(tl.where(mask, x, 0.0), axis=0) / n_cols
diff = tl.where(mask, x - mean, 0.0)
var = tl.sum(diff * diff, axis=0) / n_cols
w = tl.load({p}weight_ptr + cols, mask=mask, other=0.0)
b = tl.load({p}bias_ptr + cols, mask=mask, other=0.0)
x = diff / tl.sqrt(var + {p}eps) * w + b"""
_RMS_NORM = """\
ms = tl.sum(tl.where(mask, x * x, 0.0), axis=0) / n_cols
w = tl.load({p}weight_ptr + cols, mask=mask, other=0.0)
x = x / tl.sqrt(ms + {p}eps) * w"""
_NORMALIZE = """\
norm = tl.sqrt(tl.sum(tl.where(mask, x * x, 0.0), axis=0))
x = x / tl.maximum(norm, 1e-12)"""
_CUMSUM = """\
x = tl.cumsum(tl.where(mask, x, 0.0), axis=0)"""

# Reductions: ``x`` is one row, the result is the scalar ``x``.
_SUM = "x = tl.sum(tl.where(mask, x, 0.0), axis=0)"
_MEAN = "x = tl.sum(tl.where(mask, x, 0.0), axis=0) / n_cols"
_MAX = 'x = tl.max(tl.where(mask, x, -float("inf")), axis=0)'
_MIN = 'x = tl.min(tl.where(mask, x, float("inf")), axis=0)'
_LOGSUMEXP = """\
x_max = tl.max(tl.where(mask, x, -float("inf")), axis=0)
x = x_max + tl.log(tl.sum(tl.where(mask, tl.exp(x - x_max), 0.0), axis=0))"""
_NORM = "x = tl.sqrt(tl.sum(tl.where(mask, x * x, 0.0), axis=0))"
_VAR = """\
mean = tl.sum(tl.where(mask, x, 0.0), axis=0) / n_cols
diff = tl.where(mask, x - mean, 0.0)
x = tl.sum(diff * diff, axis=0) / (n_cols - 1)"""
_STD = """\
mean = tl.sum(tl.where(mask, x, 0.0), axis=0) / n_cols
diff = tl.where(mask, x - mean, 0.0)
x = tl.sqrt(tl.sum(diff * diff, axis=0) / (n_cols - 1))"""

OPS: tuple[Op, ...] = (
    # matmul-like: the kernel is a tiled tl.dot with the rest fused into its epilogue
    Op("torch.matmul", "matmul", "torch.matmul({x}, {y})", ""),
    Op("torch.mm", "matmul", "torch.mm({x}, {y})", ""),
    Op("torch.nn.Linear", "matmul", "self.{m}({x})", "", module="nn.Linear({k}, {n})",
       params=("weight", "bias")),
    # elementwise, one input
    _u("torch.sigmoid", "torch.sigmoid({x})", "tl.sigmoid(x)"),
    _u("torch.nn.Sigmoid", "self.{m}({x})", "tl.sigmoid(x)", "nn.Sigmoid()"),
    _u("torch.tanh", "torch.tanh({x})", "2.0 * tl.sigmoid(2.0 * x) - 1.0"),
    _u("torch.nn.Tanh", "self.{m}({x})", "2.0 * tl.sigmoid(2.0 * x) - 1.0", "nn.Tanh()"),
    _u("torch.relu", "torch.relu({x})", "tl.maximum(x, 0.0)"),
    _u("torch.nn.ReLU", "self.{m}({x})", "tl.maximum(x, 0.0)", "nn.ReLU()"),
    _u("torch.nn.GELU", "self.{m}({x})", "0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))",
       "nn.GELU()"),
    _u("torch.nn.functional.gelu", "torch.nn.functional.gelu({x})",
       "0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))"),
    _u("torch.nn.functional.silu", "torch.nn.functional.silu({x})", "x * tl.sigmoid(x)"),
    _u("torch.nn.SiLU", "self.{m}({x})", "x * tl.sigmoid(x)", "nn.SiLU()"),
    _u("torch.exp", "torch.exp(-{x} * {x})", "tl.exp(-x * x)"),
    _u("torch.log", "torch.log({x} * {x} + 1.0)", "tl.log(x * x + 1.0)"),
    _u("torch.sqrt", "torch.sqrt({x} * {x} + 1.0)", "tl.sqrt(x * x + 1.0)"),
    _u("torch.rsqrt", "torch.rsqrt({x} * {x} + 1.0)", "1.0 / tl.sqrt(x * x + 1.0)"),
    _u("torch.sin", "torch.sin({x})", "tl.sin(x)"),
    _u("torch.cos", "torch.cos({x})", "tl.cos(x)"),
    _u("torch.abs", "torch.abs({x})", "tl.abs(x)"),
    _u("torch.clamp", "torch.clamp({x}, min=-0.5, max=0.5)",
       "tl.minimum(tl.maximum(x, -0.5), 0.5)"),
    _u("torch.clip", "torch.clip({x}, min=-1.0, max=1.0)", "tl.minimum(tl.maximum(x, -1.0), 1.0)"),
    _u("torch.clamp_min", "torch.clamp_min({x}, 0.1)", "tl.maximum(x, 0.1)"),
    _u("torch.nn.functional.softplus", "torch.nn.functional.softplus({x})",
       "tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))"),
    _u("torch.nn.Softplus", "self.{m}({x})",
       "tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))", "nn.Softplus()"),
    _u("torch.nn.functional.leaky_relu", "torch.nn.functional.leaky_relu({x}, 0.1)",
       "tl.where(x > 0.0, x, x * 0.1)"),
    _u("torch.nn.LeakyReLU", "self.{m}({x})", "tl.where(x > 0.0, x, x * 0.2)",
       "nn.LeakyReLU(0.2)"),
    _u("torch.nn.ELU", "self.{m}({x})", "tl.where(x > 0.0, x, tl.exp(tl.minimum(x, 0.0)) - 1.0)",
       "nn.ELU()"),
    _u("torch.nn.Hardswish", "self.{m}({x})",
       "x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) / 6.0", "nn.Hardswish()"),
    _u("torch.nn.functional.logsigmoid", "torch.nn.functional.logsigmoid({x})",
       "tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))"),
    _u("torch.erf", "torch.erf({x})", "tl.erf(x)"),
    # elementwise, two inputs of one shape
    Op("torch.maximum", "binary", "torch.maximum({x}, {y})", "tl.maximum(x, {y})"),
    Op("torch.minimum", "binary", "torch.minimum({x}, {y})", "tl.minimum(x, {y})"),
    # whole-row operations along the last dimension
    Op("torch.softmax", "rowmap", "torch.softmax({x}, dim=-1)", _SOFTMAX),
    Op("torch.nn.Softmax", "rowmap", "self.{m}({x})", _SOFTMAX, module="nn.Softmax(dim=-1)"),
    Op("torch.log_softmax", "rowmap", "torch.log_softmax({x}, dim=-1)", _LOG_SOFTMAX),
    Op("torch.nn.LogSoftmax", "rowmap", "self.{m}({x})", _LOG_SOFTMAX,
       module="nn.LogSoftmax(dim=-1)"),
    Op("torch.nn.LayerNorm", "rowmap", "self.{m}({x})", _LAYER_NORM, module="nn.LayerNorm({n})",
       params=("weight", "bias", "eps")),
    Op("torch.nn.RMSNorm", "rowmap", "self.{m}({x})", _RMS_NORM,
       module="nn.RMSNorm({n}, eps=1e-6)", params=("weight", "eps")),
    Op("torch.nn.functional.normalize", "rowmap", "torch.nn.functional.normalize({x}, dim=-1)",
       _NORMALIZE),
    Op("torch.cumsum", "rowmap", "torch.cumsum({x}, dim=-1)", _CUMSUM),
    # row reductions along the last dimension
    Op("torch.sum", "reduce", "torch.sum({x}, dim=-1)", _SUM),
    Op("torch.mean", "reduce", "torch.mean({x}, dim=-1)", _MEAN),
    Op("torch.max", "reduce", "torch.max({x}, dim=-1).values", _MAX),
    Op("torch.amax", "reduce", "torch.amax({x}, dim=-1)", _MAX),
    Op("torch.min", "reduce", "torch.min({x}, dim=-1).values", _MIN),
    Op("torch.amin", "reduce", "torch.amin({x}, dim=-1)", _MIN),
    Op("torch.logsumexp", "reduce", "torch.logsumexp({x}, dim=-1)", _LOGSUMEXP),
    Op("torch.norm", "reduce", "torch.norm({x}, dim=-1)", _NORM),
    Op("torch.var", "reduce", "torch.var({x}, dim=-1)", _VAR),
    Op("torch.std", "reduce", "torch.std({x}, dim=-1)", _STD),
)


def ops_by_api() -> dict[str, Op]:
    """The ops keyed by API name."""
    return {op.api: op for op in OPS}
