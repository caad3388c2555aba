"""The operations the module synthesizer composes and the Triton teacher lowers.

Each ``Op`` is one canonical API (as ``kz_stream.modules.canonical_api`` names it) with two faces:
the PyTorch line a ``Model`` calls it with, and the Triton code that computes the same
thing inside a kernel. Keeping both in one record is what makes every synthesized module
come with a teacher kernel: the two cannot drift apart. Ops without a Triton face
(``triton`` None, ``teachable`` False) widen the Proposer's data only: the API sets the
Proposer is asked for reach far past what the teacher lowers (``PROPOSER_OPS``).

Kinds, in the order a module applies them:

- ``matmul``: ``x [M, K] -> [M, N]`` (at most one, always first);
- ``unary`` and ``binary``: elementwise on the running tensor (``binary`` reads a second
  input of the same shape);
- ``rowmap``: a whole-row operation along the last dimension (softmax, norms, cumsum);
- ``reduce``: a row reduction along the last dimension, ``[..., N] -> [...]`` (at most
  one, always last but for elementwise ops after it).

Kinds of the Proposer-only ops, in their place in that order:

- ``source``: makes the running tensor from an integer input (``nn.Embedding``, one-hot),
  before everything;
- ``spatial``: a layer over ``[B, C, H, W]`` (``spatial2d``) or ``[B, C, L]``
  (``spatial1d``) inputs (convolutions, batch norms, pools), before the matmul;
- ``shrink``: changes the row length (``topk``, ``pad``, ``gather``), after the
  whole-row ops;
- ``index`` and ``loss``: end the module with an integer or a 0-dim output (at most one of
  ``reduce``, ``index``, ``loss``).

PyTorch lines may also use ``{i}`` (an extra input the op reads: an index, a target, drawn
by ``extra`` in ``get_inputs``, where ``{lead}`` is the running shape without its last
dimension, ``{shape}`` all of it and ``{w}`` the row length) and ``{w}``; ``width`` is the
row length after a shrinking op.

Triton snippets use ``x`` for the running tile, ``{y}`` for a binary op's second input,
``mask`` for valid lanes, ``n_cols`` for the row length and ``{p}`` for this op's
parameter-pointer prefix. Domains are kept safe in the PyTorch line itself (``log`` of
``x * x + 1``), so every input set the verifier draws is valid for the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["OPS", "PROPOSER_OPS", "Op", "OpKind", "ops_by_api"]

OpKind = Literal[
    "matmul", "unary", "binary", "rowmap", "reduce",
    "source", "spatial1d", "spatial2d", "shrink", "index", "loss",
]


@dataclass(frozen=True)
class Op:
    """One API with its PyTorch call and its Triton lowering."""

    api: str
    kind: OpKind
    torch: str  # the expression, with {x} (and {y}, {m} for the module attribute)
    triton: str | None  # statements (rowmap/reduce) or an expression (unary/binary) over x
    module: str | None = None  # the nn module constructor, with {n} for the row length
    params: tuple[str, ...] = ()  # attributes of the nn module the kernel reads
    extra: str | None = None  # get_inputs expression of the input the line reads as {i}
    width: str | None = None  # the row length after the op, from {w} before it

    @property
    def teachable(self) -> bool:
        """Whether the Triton teacher lowers this op."""
        return self.triton is not None


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


def _p(api: str, kind: OpKind, torch: str, module: str | None = None, *,
       extra: str | None = None, width: str | None = None) -> Op:
    return Op(api, kind, torch, None, module=module, extra=extra, width=width)


_IDX = "torch.randint(0, {w}, ({lead}, 16))"  # per-row positions for gather-like ops
# Masks and labels are inputs, not comparisons in forward: `x > 0` calls torch.gt, an API
# the set did not ask for.
_MASK = "torch.rand({shape}) > 0.5"
_LABELS = "torch.randint(0, 3, ({shape},))"

# Proposer-only: PyTorch faces for the APIs the Proposer is asked for beyond the teacher's.
# Inputs are standard normal; every line keeps a module finite and non-degenerate on them.
PROPOSER_OPS: tuple[Op, ...] = (
    # sources: the running tensor from integer ids
    _p("torch.nn.Embedding", "source", "self.{m}({i})", "nn.Embedding(vocab_size, {n})",
       extra="torch.randint(0, vocab_size, ({lead},))"),
    _p("torch.nn.functional.one_hot", "source", "torch.nn.functional.one_hot({i}, {n}) * 1.0",
       extra="torch.randint(0, {n}, ({lead},))"),
    # layers over images [B, C, H, W] and sequences [B, C, L]
    _p("torch.nn.Conv2d", "spatial2d", "self.{m}({x})",
       "nn.Conv2d(channels, channels, 3, padding=1)"),
    _p("torch.nn.BatchNorm2d", "spatial2d", "self.{m}({x})", "nn.BatchNorm2d(channels)"),
    _p("torch.nn.GroupNorm", "spatial2d", "self.{m}({x})", "nn.GroupNorm(4, channels)"),
    _p("torch.nn.InstanceNorm2d", "spatial2d", "self.{m}({x})", "nn.InstanceNorm2d(channels)"),
    _p("torch.nn.MaxPool2d", "spatial2d", "self.{m}({x})", "nn.MaxPool2d(3, stride=1, padding=1)"),
    _p("torch.nn.AvgPool2d", "spatial2d", "self.{m}({x})", "nn.AvgPool2d(3, stride=1, padding=1)"),
    _p("torch.nn.AdaptiveAvgPool2d", "spatial2d", "self.{m}({x})", "nn.AdaptiveAvgPool2d(8)",
       width="8"),
    _p("torch.nn.functional.interpolate", "spatial2d",
       "torch.nn.functional.interpolate({x}, scale_factor=2.0, mode='nearest')", width="{w} * 2"),
    _p("torch.nn.ConvTranspose2d", "spatial2d", "self.{m}({x})",
       "nn.ConvTranspose2d(channels, channels, 2, stride=2)", width="{w} * 2"),
    _p("torch.nn.Upsample", "spatial2d", "self.{m}({x})", "nn.Upsample(scale_factor=2.0)",
       width="{w} * 2"),
    _p("torch.nn.ZeroPad2d", "spatial2d", "self.{m}({x})", "nn.ZeroPad2d(1)", width="{w} + 2"),
    _p("torch.nn.ReflectionPad2d", "spatial2d", "self.{m}({x})", "nn.ReflectionPad2d(1)",
       width="{w} + 2"),
    _p("torch.nn.Conv1d", "spatial1d", "self.{m}({x})",
       "nn.Conv1d(channels, channels, 3, padding=1)"),
    _p("torch.nn.BatchNorm1d", "spatial1d", "self.{m}({x})", "nn.BatchNorm1d(channels)"),
    _p("torch.nn.AvgPool1d", "spatial1d", "self.{m}({x})", "nn.AvgPool1d(3, stride=1, padding=1)"),
    _p("torch.nn.MaxPool1d", "spatial1d", "self.{m}({x})", "nn.MaxPool1d(3, stride=1, padding=1)"),
    _p("torch.nn.AdaptiveAvgPool1d", "spatial1d", "self.{m}({x})", "nn.AdaptiveAvgPool1d(16)",
       width="16"),
    _p("torch.nn.ConvTranspose1d", "spatial1d", "self.{m}({x})",
       "nn.ConvTranspose1d(channels, channels, 2, stride=2)", width="{w} * 2"),
    _p("torch.nn.ConstantPad1d", "spatial1d", "self.{m}({x})", "nn.ConstantPad1d(2, 0.0)",
       width="{w} + 4"),
    # matmul-like
    _p("torch.nn.functional.linear", "matmul", "torch.nn.functional.linear({x}, {y})"),
    _p("torch.einsum", "matmul", "torch.einsum('...k,kn->...n', {x}, {y})"),
    _p("torch.bmm", "matmul", "torch.bmm({x}, {y})"),
    # elementwise
    _p("torch.where", "unary", "torch.where({i}, {x}, 0.5 * {x})", extra=_MASK),
    _p("torch.masked_fill", "unary", "torch.masked_fill({x}, {i}, 0.0)", extra=_MASK),
    _p("torch.expm1", "unary", "torch.expm1(-{x} * {x})"),
    _p("torch.log1p", "unary", "torch.log1p({x} * {x})"),
    _p("torch.log2", "unary", "torch.log2({x} * {x} + 1.0)"),
    _p("torch.log10", "unary", "torch.log10({x} * {x} + 1.0)"),
    _p("torch.round", "unary", "torch.round({x} * 4.0)"),
    _p("torch.ceil", "unary", "torch.ceil({x} * 4.0)"),
    _p("torch.floor", "unary", "torch.floor({x} * 4.0)"),
    _p("torch.sign", "unary", "torch.sign({x})"),
    _p("torch.asinh", "unary", "torch.asinh({x})"),
    _p("torch.sinc", "unary", "torch.sinc({x})"),
    _p("torch.logit", "unary", "torch.logit({x}, eps=0.1)"),
    _p("torch.clamp_max", "unary", "torch.clamp_max({x}, 0.5)"),
    _p("torch.greater", "unary", "{x} * torch.greater({x}, 0.0)"),
    _p("torch.ge", "unary", "{x} * torch.ge({x}, 0.5)"),
    _p("torch.logical_not", "unary", "{x} * torch.logical_not({i})", extra=_MASK),
    _p("torch.scatter", "unary", "torch.scatter({x}, -1, {i}, 0.0)",
       extra="torch.randint(0, {w}, ({lead}, 4))"),
    _p("torch.nn.Hardsigmoid", "unary", "self.{m}({x})", "nn.Hardsigmoid()"),
    _p("torch.ne", "unary", "{x} * torch.ne({i}, 0)", extra=_LABELS),
    _p("torch.eq", "unary", "{x} * torch.eq({i}, 1)", extra=_LABELS),
    _p("torch.logical_and", "unary", "{x} * torch.logical_and({i}, {i}.flip(-1))", extra=_MASK),
    _p("torch.logical_or", "unary", "{x} * torch.logical_or({i}, {i}.flip(-1))", extra=_MASK),
    _p("torch.lt", "binary", "{x} * torch.lt({x}, {y})"),
    _p("torch.xlogy", "binary", "torch.xlogy({x}, {y} * {y} + 1.0)"),
    _p("torch.masked_scatter", "binary", "torch.masked_scatter({x}, {i}, {y})", extra=_MASK),
    # whole-row
    _p("torch.layer_norm", "rowmap", "torch.layer_norm({x}, ({w},))"),
    _p("torch.rms_norm", "rowmap", "torch.rms_norm({x}, ({w},))"),
    _p("torch.cumprod", "rowmap", "torch.cumprod(1.0 + 0.01 * {x} / (1.0 + {x} * {x}), dim=-1)"),
    _p("torch.tril", "rowmap", "torch.tril({x})"),  # last two dims: a rowmap's place
    _p("torch.triu", "rowmap", "torch.triu({x})"),
    _p("torch.cummax", "rowmap", "torch.cummax({x}, dim=-1).values"),
    _p("torch.cummin", "rowmap", "torch.cummin({x}, dim=-1).values"),
    _p("torch.sort", "rowmap", "torch.sort({x}, dim=-1).values"),
    # row length changes
    _p("torch.topk", "shrink", "torch.topk({x}, 8, dim=-1).values", width="8"),
    _p("torch.nn.functional.pad", "shrink", "torch.nn.functional.pad({x}, (0, 8))",
       width="{w} + 8"),
    _p("torch.gather", "shrink", "torch.gather({x}, -1, {i})", extra=_IDX, width="16"),
    _p("torch.take_along_dim", "shrink", "torch.take_along_dim({x}, {i}, dim=-1)", extra=_IDX,
       width="16"),
    _p("torch.index_select", "shrink", "torch.index_select({x}, -1, {i})",
       extra="torch.randint(0, {w}, (16,))", width="16"),
    _p("torch.nn.functional.glu", "shrink", "torch.nn.functional.glu({x}, dim=-1)",
       width="{w} // 2"),
    _p("torch.nn.GLU", "shrink", "self.{m}({x})", "nn.GLU(dim=-1)", width="{w} // 2"),
    _p("torch.diff", "shrink", "torch.diff({x}, dim=-1)", width="{w} - 1"),
    _p("torch.all", "shrink", "{x}[..., ::2] * torch.all({i}.unflatten(-1, (-1, 2)), dim=-1)",
       extra=_MASK, width="{w} // 2"),
    _p("torch.any", "shrink", "{x}[..., ::2] * torch.any({i}.unflatten(-1, (-1, 2)), dim=-1)",
       extra="torch.rand({shape}) > 0.7", width="{w} // 2"),
    # ends: a reduction, an integer output, a 0-dim loss
    # factors in [0.995, 1.005]: no row of any length overflows
    _p("torch.prod", "reduce", "torch.prod(1.0 + 0.01 * {x} / (1.0 + {x} * {x}), dim=-1)"),
    _p("torch.linalg.vector_norm", "reduce", "torch.linalg.vector_norm({x}, dim=-1)"),
    _p("torch.cosine_similarity", "reduce", "torch.cosine_similarity({x}, {y}, dim=-1)"),
    _p("torch.argmax", "index", "torch.argmax({x}, dim=-1)"),
    _p("torch.argmin", "index", "torch.argmin({x}, dim=-1)"),
    _p("torch.argsort", "index", "torch.argsort({x}, dim=-1)"),
    _p("torch.nn.CrossEntropyLoss", "loss", "self.{m}({x}.reshape(-1, {w}), {i}.reshape(-1))",
       "nn.CrossEntropyLoss()", extra="torch.randint(0, {w}, ({lead},))"),
    _p("torch.nn.functional.cross_entropy", "loss",
       "torch.nn.functional.cross_entropy({x}.reshape(-1, {w}), {i}.reshape(-1))",
       extra="torch.randint(0, {w}, ({lead},))"),
    _p("torch.nn.MSELoss", "loss", "self.{m}({x}, {i})", "nn.MSELoss()",
       extra="torch.randn({shape})"),
    _p("torch.nn.functional.mse_loss", "loss", "torch.nn.functional.mse_loss({x}, {i})",
       extra="torch.randn({shape})"),
    _p("torch.nn.L1Loss", "loss", "self.{m}({x}, {i})", "nn.L1Loss()",
       extra="torch.randn({shape})"),
    _p("torch.nn.functional.l1_loss", "loss", "torch.nn.functional.l1_loss({x}, {i})",
       extra="torch.randn({shape})"),
    _p("torch.nn.SmoothL1Loss", "loss", "self.{m}({x}, {i})", "nn.SmoothL1Loss()",
       extra="torch.randn({shape})"),
    _p("torch.nn.functional.smooth_l1_loss", "loss",
       "torch.nn.functional.smooth_l1_loss({x}, {i})", extra="torch.randn({shape})"),
    _p("torch.nn.BCEWithLogitsLoss", "loss", "self.{m}({x}, {i})", "nn.BCEWithLogitsLoss()",
       extra="torch.rand({shape})"),
    _p("torch.binary_cross_entropy_with_logits", "loss",
       "torch.binary_cross_entropy_with_logits({x}, {i})", extra="torch.rand({shape})"),
)


def ops_by_api(*, teachable: bool = True) -> dict[str, Op]:
    """The ops keyed by API name: the teacher's, or (``teachable`` False) the Proposer's too."""
    ops = OPS if teachable else (*OPS, *PROPOSER_OPS)
    return {op.api: op for op in ops}
