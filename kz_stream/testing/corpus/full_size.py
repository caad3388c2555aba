"""Reference problems at KernelBench's published sizes, with honest Triton kernels and two
cheats, for checking the verifier on problems as big as the real benchmark's.

Each problem is a KernelBench-format source template whose sizes are module-level
constants (``$NAME`` placeholders): ``SizedProblem.source(full=True)`` renders it at the
published size (inputs of up to 8.6 GB, for the GPU tests), ``source(full=False)`` at a
size the CPU path (the Triton interpreter) checks in seconds. The problems are written for
this project after the ops and sizes of KernelBench levels 1-3; none is KernelBench's text.

The honest kernels are shape-generic (grids and strides come from the actual inputs), do
all compute in ``@triton.jit`` kernels, accumulate in float32 with tree reductions and use
no TF32, so the same source is right at both sizes. Losses reduce in two deterministic
stages (per-block partial sums, then one program), never with float atomics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from string import Template
from typing import Any

HEADER = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"


@dataclass(frozen=True)
class SizedProblem:
    """A reference template, its published (``full``) and CPU (``small``) sizes."""

    name: str
    template: str
    full: dict[str, int]
    small: dict[str, int]
    category: str
    kernelbench: str = field(default="")  # the level/problem whose op and sizes it follows

    def source(self, full: bool) -> str:
        """The reference source with its size constants filled in."""
        return Template(self.template).substitute(self.full if full else self.small)


def _problem(name: str, category: str, kernelbench: str, body: str,
             full: dict[str, int], small: dict[str, int]) -> SizedProblem:
    return SizedProblem(name, HEADER + body, full, small, category, kernelbench)


# ---- reference problems ----------------------------------------------------------------

_ELEMENTWISE_FULL = {"ROWS": 4096, "COLS": 393216}
_ELEMENTWISE_SMALL = {"ROWS": 64, "COLS": 3072}


def _activation(name: str, kb: str, expr: str, init: str = "", args: str = "") -> SizedProblem:
    ctor = (f"    def __init__(self{', ' + args if args else ''}):\n"
            f"        super().__init__()\n{init}\n" if init else "")
    body = f'''

class Model(nn.Module):
    """Applies one activation elementwise."""

{ctor}    def forward(self, x):
        return {expr}


rows = $ROWS
cols = $COLS


def get_inputs():
    return [torch.rand(rows, cols)]


def get_init_inputs():
    return [{'0.01' if args else ''}]
'''
    return _problem(name, "activation", kb, body, _ELEMENTWISE_FULL, _ELEMENTWISE_SMALL)


RELU = _activation("relu", "level1/19", "torch.relu(x)")
GELU = _activation("gelu", "level1/26", "F.gelu(x)")
SIGMOID = _activation("sigmoid", "level1/21", "torch.sigmoid(x)")
TANH = _activation("tanh", "level1/22", "torch.tanh(x)")
SOFTPLUS = _activation("softplus", "level1/29", "F.softplus(x)")
LEAKY_RELU = _activation("leaky_relu", "level1/20", "F.leaky_relu(x, self.slope)",
                         init="        self.slope = slope\n", args="slope")

THRESHOLD_MASK = _problem("threshold_mask", "bool_output", "level1/19 (sizes)", '''

class Model(nn.Module):
    """Marks the elements above a threshold: a bool output."""

    def __init__(self, threshold):
        super().__init__()
        self.threshold = threshold

    def forward(self, x):
        return x > self.threshold


rows = $ROWS
cols = $COLS


def get_inputs():
    return [torch.rand(rows, cols)]


def get_init_inputs():
    return [0.5]
''', _ELEMENTWISE_FULL, _ELEMENTWISE_SMALL)

SOFTMAX = _problem("softmax", "softmax", "level1/23", '''

class Model(nn.Module):
    """Softmax along each row."""

    def forward(self, x):
        return torch.softmax(x, dim=1)


rows = $ROWS
cols = $COLS


def get_inputs():
    return [torch.rand(rows, cols)]


def get_init_inputs():
    return []
''', _ELEMENTWISE_FULL, _ELEMENTWISE_SMALL)

LOG_SOFTMAX = _problem("log_softmax", "softmax", "level1/24", '''

class Model(nn.Module):
    """Log-softmax along a dim."""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return torch.log_softmax(x, dim=self.dim)


rows = $ROWS
cols = $COLS


def get_inputs():
    return [torch.rand(rows, cols)]


def get_init_inputs():
    return [1]
''', _ELEMENTWISE_FULL, _ELEMENTWISE_SMALL)

_PAIR_FULL = {"BATCH": 32768, "DIM": 32768}
_PAIR_SMALL = {"BATCH": 512, "DIM": 1024}

HINGE_LOSS = _problem("hinge_loss", "loss", "level1/100", '''

class Model(nn.Module):
    """Mean hinge loss; the +-1 labels broadcast along the last dim."""

    def forward(self, predictions, targets):
        return torch.clamp(1 - predictions * targets, min=0).mean()


batch = $BATCH
dim = $DIM


def get_inputs():
    labels = torch.randint(0, 2, (dim,)).float() * 2 - 1
    return [torch.rand(batch, dim), labels]


def get_init_inputs():
    return []
''', _PAIR_FULL, _PAIR_SMALL)

MSE_LOSS = _problem("mse_loss", "loss", "level1/94", '''

class Model(nn.Module):
    """Mean squared error over every element."""

    def forward(self, predictions, targets):
        return ((predictions - targets) ** 2).mean()


batch = $BATCH
dim = $DIM


def get_inputs():
    s = torch.rand(())
    return [torch.rand(batch, dim) * s, torch.rand(batch, dim)]


def get_init_inputs():
    return []
''', _PAIR_FULL, _PAIR_SMALL)

HUBER_LOSS = _problem("huber_loss", "loss", "level1/96", '''

class Model(nn.Module):
    """Smooth L1 (Huber, beta 1) loss, averaged."""

    def forward(self, predictions, targets):
        return F.smooth_l1_loss(predictions, targets)


batch = $BATCH
dim = $DIM


def get_inputs():
    s = torch.rand(())
    return [torch.rand(batch, dim) * s, torch.rand(batch, dim)]


def get_init_inputs():
    return []
''', _PAIR_FULL, _PAIR_SMALL)

KL_DIV_LOSS = _problem("kl_div_loss", "loss", "level1/98", '''

class Model(nn.Module):
    """KL divergence of two row distributions, summed and divided by the batch size."""

    def forward(self, predictions, targets):
        return F.kl_div(torch.log(predictions), targets, reduction="batchmean")


batch = $BATCH
dim = $DIM


def get_inputs():
    s = torch.rand(())
    p = (torch.rand(batch, dim) * s).softmax(dim=-1)
    return [p, torch.rand(batch, dim).softmax(dim=-1)]


def get_init_inputs():
    return []
''', {"BATCH": 16384, "DIM": 16384}, _PAIR_SMALL)

_TRIPLE_FULL = {"BATCH": 32768, "DIM": 8192}
_TRIPLE_SMALL = {"BATCH": 512, "DIM": 1024}

COSINE_LOSS = _problem("cosine_loss", "loss", "level1 loss family (sizes of 99)", '''

class Model(nn.Module):
    """One minus the cosine similarity of paired rows, averaged."""

    def forward(self, predictions, targets):
        return torch.mean(1 - F.cosine_similarity(predictions, targets, dim=1))


batch = $BATCH
dim = $DIM


def get_inputs():
    return [torch.rand(batch, dim), torch.rand(batch, dim)]


def get_init_inputs():
    return []
''', _TRIPLE_FULL, _TRIPLE_SMALL)

TRIPLET_LOSS = _problem("triplet_loss", "loss", "level1/99", '''

class Model(nn.Module):
    """Triplet margin loss (Euclidean distances), averaged."""

    def __init__(self, margin):
        super().__init__()
        self.loss = nn.TripletMarginLoss(margin=margin)

    def forward(self, anchor, positive, negative):
        return self.loss(anchor, positive, negative)


batch = $BATCH
dim = $DIM


def get_inputs():
    s = torch.rand(())
    return [torch.rand(batch, dim) * s, torch.rand(batch, dim), torch.rand(batch, dim)]


def get_init_inputs():
    return [1.0]
''', _TRIPLE_FULL, _TRIPLE_SMALL)

CROSS_ENTROPY = _problem("cross_entropy", "loss", "level1/95", '''

class Model(nn.Module):
    """Cross-entropy of logits against class indices, averaged."""

    def forward(self, logits, labels):
        return F.cross_entropy(logits, labels)


batch = $BATCH
classes = $CLASSES


def get_inputs():
    return [torch.rand(batch, classes), torch.randint(0, classes, (batch,))]


def get_init_inputs():
    return []
''', {"BATCH": 32768, "CLASSES": 4096}, {"BATCH": 512, "CLASSES": 256})

_REDUCE_FULL = {"B": 128, "R": 4096, "C": 4095}
_REDUCE_SMALL = {"B": 16, "R": 256, "C": 255}


def _reduction(name: str, kb: str, doc: str, expr: str, category: str = "reduction"
               ) -> SizedProblem:
    body = f'''

class Model(nn.Module):
    """{doc}"""

    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return {expr}


b = $B
r = $R
c = $C


def get_inputs():
    return [torch.rand(b, r, c)]


def get_init_inputs():
    return [1]
'''
    return _problem(name, category, kb, body, _REDUCE_FULL, _REDUCE_SMALL)


SUM_DIM = _reduction("sum_dim", "level1/47", "Sum over one dim, kept as size 1.",
                     "torch.sum(x, dim=self.dim, keepdim=True)")
MEAN_DIM = _reduction("mean_dim", "level1/48", "Mean over one dim.",
                      "torch.mean(x, dim=self.dim)")
MAX_DIM = _reduction("max_dim", "level1/49", "Largest value over one dim.",
                     "torch.max(x, dim=self.dim)[0]")
ARGMAX_DIM = _reduction("argmax_dim", "level1/51", "Index of the largest value over one dim "
                        "(int64).", "torch.argmax(x, dim=self.dim)")
MAX_WITH_INDEX = _reduction("max_with_index", "level1/49 (both outputs)",
                            "Largest value and its index over one dim: a tuple.",
                            "tuple(torch.max(x, dim=self.dim))", category="tuple_output")

LAYER_NORM = _problem("layer_norm", "norm", "level1/40", '''

class Model(nn.Module):
    """Layer norm over the last three dims, with its affine weights."""

    def __init__(self, shape):
        super().__init__()
        self.ln = nn.LayerNorm(shape)

    def forward(self, x):
        return self.ln(x)


batch = $BATCH
features = $FEATURES
d1 = $D1
d2 = $D2


def get_inputs():
    return [torch.rand(batch, features, d1, d2)]


def get_init_inputs():
    return [(features, d1, d2)]
''', {"BATCH": 16, "FEATURES": 64, "D1": 256, "D2": 256},
    {"BATCH": 16, "FEATURES": 16, "D1": 64, "D2": 64})

RMS_NORM = _problem("rms_norm", "norm", "level1/36", '''

class Model(nn.Module):
    """Divides by the root mean square over the feature dim (dim 1)."""

    def __init__(self, features, eps=1e-5):
        super().__init__()
        self.features = features
        self.eps = eps

    def forward(self, x):
        return x / torch.sqrt(torch.mean(x * x, dim=1, keepdim=True) + self.eps)


batch = $BATCH
features = $FEATURES
d1 = $D1
d2 = $D2


def get_inputs():
    return [torch.rand(batch, features, d1, d2)]


def get_init_inputs():
    return [features]
''', {"BATCH": 112, "FEATURES": 64, "D1": 512, "D2": 512},
    {"BATCH": 16, "FEATURES": 64, "D1": 64, "D2": 64})

L2_NORM = _problem("l2_norm", "norm", "level1/39", '''

class Model(nn.Module):
    """Scales each row to unit Euclidean norm."""

    def forward(self, x):
        return x / torch.norm(x, p=2, dim=1, keepdim=True)


rows = $ROWS
cols = $COLS


def get_inputs():
    return [torch.rand(rows, cols)]


def get_init_inputs():
    return []
''', {"ROWS": 32768, "COLS": 65535}, {"ROWS": 256, "COLS": 4095})

MATMUL = _problem("matmul", "matmul", "level1/1", '''

class Model(nn.Module):
    """A square matrix product."""

    def forward(self, a, b):
        return torch.matmul(a, b)


n = $N


def get_inputs():
    return [torch.rand(n, n), torch.rand(n, n)]


def get_init_inputs():
    return []
''', {"N": 4096}, {"N": 256})

GEMM_MUL_LEAKY = _problem("gemm_mul_leaky", "fused_level2", "level2/12", '''

class Model(nn.Module):
    """Linear layer, times a constant, then leaky ReLU."""

    def __init__(self, in_features, out_features, multiplier, slope):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.multiplier = multiplier
        self.slope = slope

    def forward(self, x):
        return F.leaky_relu(self.gemm(x) * self.multiplier, self.slope)


batch = $BATCH
in_features = $IN
out_features = $OUT


def get_inputs():
    return [torch.rand(batch, in_features)]


def get_init_inputs():
    return [in_features, out_features, 2.0, 0.1]
''', {"BATCH": 1024, "IN": 8192, "OUT": 8192}, {"BATCH": 128, "IN": 512, "OUT": 256})

GEMM_SUM_SCALE = _problem("gemm_sum_scale", "fused_level2", "level2/14", '''

class Model(nn.Module):
    """x @ W^T, halved, summed over the features (kept as size 1), then scaled."""

    def __init__(self, in_features, hidden, scale):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden, in_features))
        self.scale = scale

    def forward(self, x):
        y = torch.matmul(x, self.weight.T) / 2
        return torch.sum(y, dim=1, keepdim=True) * self.scale


batch = $BATCH
in_features = $IN
hidden = $HIDDEN


def get_inputs():
    return [torch.rand(batch, in_features)]


def get_init_inputs():
    return [in_features, hidden, 1.5]
''', {"BATCH": 1024, "IN": 8192, "HIDDEN": 8192}, {"BATCH": 128, "IN": 512, "HIDDEN": 256})

MLP = _problem("mlp", "block_level3", "level3/1", '''

class Model(nn.Module):
    """Linear+ReLU hidden layers, then a linear output layer."""

    def __init__(self, in_features, hidden, out_features):
        super().__init__()
        layers = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, out_features))
        self.network = nn.Sequential(*layers)

    def forward(self, x):
        return self.network(x)


batch = $BATCH
in_features = $IN
hidden = [$HIDDEN, $HIDDEN]
out_features = $OUT


def get_inputs():
    return [torch.rand(batch, in_features)]


def get_init_inputs():
    return [in_features, hidden, out_features]
''', {"BATCH": 128, "IN": 16384, "HIDDEN": 16384, "OUT": 8192},
    {"BATCH": 64, "IN": 512, "HIDDEN": 256, "OUT": 128})

RESIDUAL_BLOCK = _problem("residual_block", "block_level3", "level3 (a transformer-style block)",
                          '''

class Model(nn.Module):
    """x + GELU(LayerNorm(Linear(x))): a residual block."""

    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return x + F.gelu(self.norm(self.fc(x)))


batch = $BATCH
dim = $DIM


def get_inputs():
    return [torch.rand(batch, dim)]


def get_init_inputs():
    return [dim]
''', {"BATCH": 4096, "DIM": 2048}, {"BATCH": 256, "DIM": 512})

FULL_SIZE_PROBLEMS: dict[str, SizedProblem] = {p.name: p for p in (
    HINGE_LOSS, MSE_LOSS, HUBER_LOSS, KL_DIV_LOSS, COSINE_LOSS, TRIPLET_LOSS, CROSS_ENTROPY,
    SUM_DIM, MEAN_DIM, MAX_DIM, ARGMAX_DIM, MAX_WITH_INDEX,
    SOFTMAX, LOG_SOFTMAX,
    RELU, GELU, SIGMOID, LEAKY_RELU, TANH, SOFTPLUS, THRESHOLD_MASK,
    LAYER_NORM, RMS_NORM, L2_NORM,
    MATMUL, GEMM_MUL_LEAKY, GEMM_SUM_SCALE, MLP, RESIDUAL_BLOCK,
)}

# ---- honest Triton kernels -----------------------------------------------------------------

KHEADER = '''
import torch
import torch.nn as nn
import triton
import triton.language as tl
'''


def _elementwise(kernel: str, expr: str, init: str = "", extra_arg: str = "",
                 out_dtype: str = "x.dtype") -> str:
    """A flat elementwise kernel: ``expr`` maps ``x`` (a float32 block) to the output."""
    arg = f", {extra_arg}" if extra_arg else ""
    call_arg = f", float(self.{extra_arg})" if extra_arg else ""
    ctor = (f"    def __init__(self, {extra_arg}):\n        super().__init__()\n"
            f"        self.{extra_arg} = {extra_arg}\n\n") if extra_arg else ""
    return KHEADER + f'''

@triton.jit
def {kernel}(x_ptr, y_ptr, n{arg}, BLOCK: tl.constexpr):
    # int64 offsets: the published inputs hold up to 2**31 - 1 elements.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
{init}    tl.store(y_ptr + offs, {expr}, mask=mask)


class ModelNew(nn.Module):
{ctor}    def forward(self, x):
        x = x.contiguous()
        y = torch.empty(x.shape, device=x.device, dtype={out_dtype})
        n = x.numel()
        {kernel}[(triton.cdiv(n, 4096),)](x, y, n{call_arg}, BLOCK=4096)
        return y
'''


H_RELU = _elementwise("relu_kernel", "tl.maximum(x, 0.0)")
H_GELU = _elementwise("gelu_kernel", "0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))")
H_SIGMOID = _elementwise("sigmoid_kernel", "1.0 / (1.0 + tl.exp(-x))")
H_LEAKY_RELU = _elementwise("leaky_relu_kernel", "tl.where(x >= 0, x, x * slope)",
                            extra_arg="slope")
# tanh from exp(-2|x|) loses relative precision near 0, where an odd series takes over.
H_TANH = _elementwise("tanh_kernel", "tl.where(x < 0, -t, t)", init='''\
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    a2 = a * a
    small = a * (1.0 + a2 * (-1.0 / 3 + a2 * (2.0 / 15 + a2 * (-17.0 / 315
                                                              + a2 * (62.0 / 2835)))))
    t = tl.where(a < 0.125, small, big)
''')
# softplus(x) = max(x, 0) + log1p(exp(-|x|)); log1p by the (1+u)-1 correction trick.
H_SOFTPLUS = _elementwise("softplus_kernel", "tl.where(x > 20.0, x, sp)", init='''\
    u = tl.exp(-tl.abs(x))
    w = 1.0 + u
    log1p = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
    sp = tl.maximum(x, 0.0) + log1p
''')
H_THRESHOLD_MASK = _elementwise("threshold_kernel", "x > threshold", extra_arg="threshold",
                                out_dtype="torch.bool")

H_SOFTMAX_BASE = '''

@triton.jit
def row_stats_kernel(x_ptr, m_ptr, s_ptr, cols, stride, BLOCK: tl.constexpr):
    """Online max and sum of exp per row, one running pair per lane, merged at the end."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    # A finite floor, not -inf: exp(m - m_new) must not be exp(-inf + inf).
    m = tl.full([BLOCK], -3.0e38, tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < cols, other=-float("inf"))
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    big = tl.max(m, axis=0)
    tl.store(m_ptr + row, big)
    tl.store(s_ptr + row, tl.sum(s * tl.exp(m - big), axis=0))
'''

H_SOFTMAX = KHEADER + H_SOFTMAX_BASE + '''

@triton.jit
def softmax_write_kernel(x_ptr, y_ptr, m_ptr, s_ptr, cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    m = tl.load(m_ptr + row)
    s = tl.load(s_ptr + row)
    x = tl.load(x_ptr + row * stride + offs, mask=mask, other=0.0)
    tl.store(y_ptr + row * stride + offs, tl.exp(x - m) / s, mask=mask)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        rows, cols = x.shape
        y = torch.empty_like(x)
        m = torch.empty(rows, device=x.device, dtype=torch.float32)
        s = torch.empty(rows, device=x.device, dtype=torch.float32)
        row_stats_kernel[(rows,)](x, m, s, cols, x.stride(0), BLOCK=4096)
        softmax_write_kernel[(rows, triton.cdiv(cols, 4096))](x, y, m, s, cols, x.stride(0),
                                                              BLOCK=4096)
        return y
'''

H_LOG_SOFTMAX = KHEADER + H_SOFTMAX_BASE + '''

@triton.jit
def log_softmax_write_kernel(x_ptr, y_ptr, m_ptr, s_ptr, cols, stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    shift = tl.load(m_ptr + row) + tl.log(tl.load(s_ptr + row))
    x = tl.load(x_ptr + row * stride + offs, mask=mask, other=0.0)
    tl.store(y_ptr + row * stride + offs, x - shift, mask=mask)


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        # Reduces over the last dim: the module's dim (1 of a 2-D input) moved there.
        x = x.transpose(self.dim, -1).contiguous()
        cols = x.shape[-1]
        rows = x.numel() // cols
        y = torch.empty_like(x)
        m = torch.empty(rows, device=x.device, dtype=torch.float32)
        s = torch.empty(rows, device=x.device, dtype=torch.float32)
        row_stats_kernel[(rows,)](x, m, s, cols, cols, BLOCK=4096)
        log_softmax_write_kernel[(rows, triton.cdiv(cols, 4096))](x, y, m, s, cols, cols,
                                                                  BLOCK=4096)
        return y.transpose(self.dim, -1)
'''

# Losses: a per-block partial sum, then one program sums the partials in a tree.
_FINAL_SUM = '''

@triton.jit
def final_sum_kernel(part_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(part_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr, tl.sum(acc, axis=0) * scale)


def finish(part, scale):
    out = torch.empty((), device=part.device, dtype=torch.float32)
    final_sum_kernel[(1,)](part, out, part.numel(), scale, BLOCK=4096)
    return out
'''


def _flat_loss(kernel: str, args: str, loads: str, term: str, scale: str,
               fwd_args: str) -> str:
    """A mean-style loss over all elements of same-shape inputs ``fwd_args``."""
    ptrs = ", ".join(f"{a}_ptr" for a in args.split(", "))
    return KHEADER + _FINAL_SUM + f'''

@triton.jit
def {kernel}({ptrs}, part_ptr, n, cols, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
{loads}    tl.store(part_ptr + pid, tl.sum(tl.where(mask, {term}, 0.0), axis=0))


class ModelNew(nn.Module):
    def forward(self, {fwd_args}):
        {fwd_args.split(", ")[0]} = {fwd_args.split(", ")[0]}.contiguous()
        first = {fwd_args.split(", ")[0]}
        n = first.numel()
        cols = first.shape[-1]
        grid = triton.cdiv(n, 4096)
        part = torch.empty(grid, device=first.device, dtype=torch.float32)
        {kernel}[(grid,)]({", ".join(f"{a}.contiguous()" for a in fwd_args.split(", "))},
            part, n, cols, BLOCK=4096)
        return finish(part, {scale})
'''


H_HINGE_LOSS = _flat_loss(
    "hinge_part_kernel", "p, t", '''\
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    # The labels broadcast along the last dim: label of column offs % cols.
    t = tl.load(t_ptr + offs % cols, mask=mask, other=0.0)
''', "tl.maximum(1.0 - p * t, 0.0)", "1.0 / n", "predictions, targets")
H_MSE_LOSS = _flat_loss(
    "mse_part_kernel", "p, t", '''\
    d = tl.load(p_ptr + offs, mask=mask, other=0.0) - tl.load(t_ptr + offs, mask=mask, other=0.0)
''', "d * d", "1.0 / n", "predictions, targets")
H_HUBER_LOSS = _flat_loss(
    "huber_part_kernel", "p, t", '''\
    d = tl.abs(tl.load(p_ptr + offs, mask=mask, other=0.0)
               - tl.load(t_ptr + offs, mask=mask, other=0.0))
''', "tl.where(d < 1.0, 0.5 * d * d, d - 0.5)", "1.0 / n", "predictions, targets")
# t * log(t / p): one log of the ratio keeps the rounding off the two large logs' difference.
# As torch, 0 where t is 0 and NaN where p or t is negative (outside the domain).
H_KL_DIV_LOSS = _flat_loss(
    "kl_part_kernel", "p, t", '''\
    p = tl.load(p_ptr + offs, mask=mask, other=1.0)
    t = tl.load(t_ptr + offs, mask=mask, other=0.0)
    kl = tl.where(t == 0, 0.0, t * tl.log(t / p))
    kl = tl.where((p < 0) | (t < 0), float("nan"), kl)
''', "kl", "1.0 / first.shape[0]", "predictions, targets")

H_COSINE_LOSS = KHEADER + _FINAL_SUM + '''

@triton.jit
def cosine_rows_kernel(a_ptr, b_ptr, part_ptr, cols, BLOCK: tl.constexpr):
    """1 - cos(a_row, b_row) per row."""
    row = tl.program_id(0).to(tl.int64)
    dot = tl.zeros([BLOCK], dtype=tl.float32)
    na = tl.zeros([BLOCK], dtype=tl.float32)
    nb = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        a = tl.load(a_ptr + row * cols + offs, mask=mask, other=0.0)
        b = tl.load(b_ptr + row * cols + offs, mask=mask, other=0.0)
        dot += a * b
        na += a * a
        nb += b * b
    eps = 1e-8
    norm_a = tl.maximum(tl.sqrt_rn(tl.sum(na, axis=0)), eps)
    norm_b = tl.maximum(tl.sqrt_rn(tl.sum(nb, axis=0)), eps)
    tl.store(part_ptr + row, 1.0 - tl.sum(dot, axis=0) / (norm_a * norm_b))


class ModelNew(nn.Module):
    def forward(self, predictions, targets):
        a, b = predictions.contiguous(), targets.contiguous()
        rows, cols = a.shape
        part = torch.empty(rows, device=a.device, dtype=torch.float32)
        cosine_rows_kernel[(rows,)](a, b, part, cols, BLOCK=1024)
        return finish(part, 1.0 / rows)
'''

H_TRIPLET_LOSS = KHEADER + _FINAL_SUM + '''

@triton.jit
def triplet_rows_kernel(a_ptr, p_ptr, n_ptr, part_ptr, cols, margin, BLOCK: tl.constexpr):
    """max(|a - p + eps| - |a - n + eps| + margin, 0) per row (the pairwise-distance eps)."""
    row = tl.program_id(0).to(tl.int64)
    dp = tl.zeros([BLOCK], dtype=tl.float32)
    dn = tl.zeros([BLOCK], dtype=tl.float32)
    eps = 1e-6
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        a = tl.load(a_ptr + row * cols + offs, mask=mask, other=0.0)
        p = tl.load(p_ptr + row * cols + offs, mask=mask, other=0.0)
        n = tl.load(n_ptr + row * cols + offs, mask=mask, other=0.0)
        u = tl.where(mask, a - p + eps, 0.0)
        v = tl.where(mask, a - n + eps, 0.0)
        dp += u * u
        dn += v * v
    d = tl.sqrt_rn(tl.sum(dp, axis=0)) - tl.sqrt_rn(tl.sum(dn, axis=0)) + margin
    tl.store(part_ptr + row, tl.maximum(d, 0.0))


class ModelNew(nn.Module):
    def __init__(self, margin):
        super().__init__()
        self.margin = margin

    def forward(self, anchor, positive, negative):
        a, p, n = anchor.contiguous(), positive.contiguous(), negative.contiguous()
        rows, cols = a.shape
        part = torch.empty(rows, device=a.device, dtype=torch.float32)
        triplet_rows_kernel[(rows,)](a, p, n, part, cols, float(self.margin), BLOCK=1024)
        return finish(part, 1.0 / rows)
'''

H_CROSS_ENTROPY = KHEADER + _FINAL_SUM + '''

@triton.jit
def ce_rows_kernel(x_ptr, label_ptr, part_ptr, cols, BLOCK: tl.constexpr):
    """logsumexp(row) - row[label], the log-sum-exp online with one pair per lane."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * cols
    m = tl.full([BLOCK], -3.0e38, tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < cols, other=-float("inf"))
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    big = tl.max(m, axis=0)
    lse = big + tl.log(tl.sum(s * tl.exp(m - big), axis=0))
    label = tl.load(label_ptr + row)
    tl.store(part_ptr + row, lse - tl.load(base + label))


class ModelNew(nn.Module):
    def forward(self, logits, labels):
        x = logits.contiguous()
        rows, cols = x.shape
        part = torch.empty(rows, device=x.device, dtype=torch.float32)
        ce_rows_kernel[(rows,)](x, labels.contiguous(), part, cols,
                                BLOCK=min(4096, triton.next_power_of_2(cols)))
        return finish(part, 1.0 / rows)
'''

# Reductions over the middle dim of (B, R, C): each program owns a block of columns and
# walks R with a [BR, BC] tile, so each lane's chain is R / BR long before the tree.
_MID = '''
def mid_view(x, dim):
    """x as (outer, reduced, inner) sizes, contiguous."""
    x = x.contiguous()
    outer = 1
    for d in x.shape[:dim]:
        outer *= d
    inner = x.numel() // (outer * x.shape[dim]) if x.numel() else 1
    return x, outer, x.shape[dim], inner


def out_shape(x, dim, keep):
    shape = list(x.shape)
    if keep:
        shape[dim] = 1
    else:
        shape.pop(dim)
    return shape
'''


def _mid_reduction(kernel: str, body: str, ret: str, outs: str, keep: str = "False") -> str:
    return KHEADER + _MID + f'''

@triton.jit
def {kernel}(x_ptr, {outs}, R, C, BR: tl.constexpr, BC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cols < C
    rr = tl.arange(0, BR)
    base = x_ptr + b * R * C
{body}

class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        x, outer, r, inner = mid_view(x, self.dim)
        shape = out_shape(x, self.dim, {keep})
{ret}
        return result
'''


H_SUM_DIM = _mid_reduction("sum_mid_kernel", '''\
    acc = tl.zeros([BR, BC], dtype=tl.float32)
    for start in range(0, R, BR):
        rows = start + rr
        m = (rows[:, None] < R) & cmask[None, :]
        acc += tl.load(base + rows[:, None] * C + cols[None, :], mask=m, other=0.0)
    tl.store(y_ptr + b * C + cols, tl.sum(acc, axis=0) * scale, mask=cmask)
''', '''\
        result = torch.empty(shape, device=x.device, dtype=x.dtype)
        sum_mid_kernel[(outer, triton.cdiv(inner, 128))](x, result, 1.0, r, inner,
                                                         BR=32, BC=128)''',
    "y_ptr, scale", keep="True")
# The mean is the sum kernel scaled by 1 / R, without the kept dim.
H_MEAN_DIM = H_SUM_DIM.replace("out_shape(x, self.dim, True)", "out_shape(x, self.dim, False)"
                               ).replace("(x, result, 1.0, r,", "(x, result, 1.0 / r, r,")
H_MAX_DIM = _mid_reduction("max_mid_kernel", '''\
    acc = tl.full([BR, BC], -float("inf"), tl.float32)
    for start in range(0, R, BR):
        rows = start + rr
        m = (rows[:, None] < R) & cmask[None, :]
        acc = tl.maximum(acc, tl.load(base + rows[:, None] * C + cols[None, :], mask=m,
                                      other=-float("inf")))
    tl.store(y_ptr + b * C + cols, tl.max(acc, axis=0), mask=cmask)
''', '''\
        result = torch.empty(shape, device=x.device, dtype=x.dtype)
        max_mid_kernel[(outer, triton.cdiv(inner, 128))](x, result, r, inner, BR=32, BC=128)''',
    "y_ptr")

# Per lane, a strictly larger value replaces the best, so each lane keeps its first
# maximum; across lanes the smallest index among the maxima wins, as torch's first one.
_ARGMAX_BODY = '''\
    best = tl.full([BR, BC], -float("inf"), tl.float32)
    idx = tl.zeros([BR, BC], dtype=tl.int64)
    for start in range(0, R, BR):
        rows = start + rr
        m = (rows[:, None] < R) & cmask[None, :]
        x = tl.load(base + rows[:, None] * C + cols[None, :], mask=m, other=-float("inf"))
        better = x > best
        best = tl.where(better, x, best)
        idx = tl.where(better, rows[:, None].to(tl.int64), idx)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top[None, :], idx, R), axis=0)
'''
H_ARGMAX_DIM = _mid_reduction("argmax_mid_kernel", _ARGMAX_BODY + '''\
    tl.store(i_ptr + b * C + cols, first, mask=cmask)
''', '''\
        result = torch.empty(shape, device=x.device, dtype=torch.int64)
        argmax_mid_kernel[(outer, triton.cdiv(inner, 128))](x, result, r, inner,
                                                            BR=32, BC=128)''',
    "i_ptr")
H_MAX_WITH_INDEX = _mid_reduction("max_index_mid_kernel", _ARGMAX_BODY + '''\
    tl.store(v_ptr + b * C + cols, top, mask=cmask)
    tl.store(i_ptr + b * C + cols, first, mask=cmask)
''', '''\
        values = torch.empty(shape, device=x.device, dtype=x.dtype)
        indices = torch.empty(shape, device=x.device, dtype=torch.int64)
        max_index_mid_kernel[(outer, triton.cdiv(inner, 128))](x, values, indices, r, inner,
                                                               BR=32, BC=128)
        result = (values, indices)''', "v_ptr, i_ptr")

# Layer norm over a 4M-element row: per-chunk mean and centred sum of squares, merged per
# row with Chan's formula, then a fully parallel normalising pass.
H_LAYER_NORM = KHEADER + '''

@triton.jit
def ln_chunk_stats_kernel(x_ptr, mean_ptr, m2_ptr, N, CHUNK: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    nchunks = tl.num_programs(1)
    start = chunk * CHUNK
    count = tl.minimum(N - start, CHUNK)
    base = x_ptr + row * N + start
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, CHUNK, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        acc += tl.load(base + offs, mask=offs < count, other=0.0)
    mean = tl.sum(acc, axis=0) / count
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, CHUNK, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < count
        d = tl.where(mask, tl.load(base + offs, mask=mask, other=0.0) - mean, 0.0)
        acc += d * d
    tl.store(mean_ptr + row * nchunks + chunk, mean)
    tl.store(m2_ptr + row * nchunks + chunk, tl.sum(acc, axis=0))


@triton.jit
def ln_row_stats_kernel(mean_ptr, m2_ptr, out_ptr, N, nchunks, eps, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, nchunks, BLOCK):
        c = off + tl.arange(0, BLOCK)
        mask = c < nchunks
        cnt = tl.where(mask, tl.minimum(N - c * CHUNK, CHUNK), 0).to(tl.float32)
        acc += cnt * tl.load(mean_ptr + row * nchunks + c, mask=mask, other=0.0)
    mean = tl.sum(acc, axis=0) / N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, nchunks, BLOCK):
        c = off + tl.arange(0, BLOCK)
        mask = c < nchunks
        cnt = tl.where(mask, tl.minimum(N - c * CHUNK, CHUNK), 0).to(tl.float32)
        d = tl.load(mean_ptr + row * nchunks + c, mask=mask, other=0.0) - mean
        acc += tl.load(m2_ptr + row * nchunks + c, mask=mask, other=0.0) + cnt * d * d
    var = tl.sum(acc, axis=0) / N
    tl.store(out_ptr + 2 * row, mean)
    tl.store(out_ptr + 2 * row + 1, 1.0 / tl.sqrt_rn(var + eps))


@triton.jit
def ln_apply_kernel(x_ptr, w_ptr, b_ptr, stats_ptr, y_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    mean = tl.load(stats_ptr + 2 * row)
    rstd = tl.load(stats_ptr + 2 * row + 1)
    x = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0)
    tl.store(y_ptr + row * N + offs, (x - mean) * rstd * w + b, mask=mask)


class ModelNew(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.ln = nn.LayerNorm(shape)

    def forward(self, x):
        x = x.contiguous()
        N = self.ln.weight.numel()
        rows = x.numel() // N
        chunk = 16384
        nchunks = triton.cdiv(N, chunk)
        means = torch.empty((rows, nchunks), device=x.device, dtype=torch.float32)
        m2s = torch.empty((rows, nchunks), device=x.device, dtype=torch.float32)
        stats = torch.empty((rows, 2), device=x.device, dtype=torch.float32)
        y = torch.empty_like(x)
        ln_chunk_stats_kernel[(rows, nchunks)](x, means, m2s, N, CHUNK=chunk, BLOCK=2048)
        ln_row_stats_kernel[(rows,)](means, m2s, stats, N, nchunks, self.ln.eps, CHUNK=chunk,
                                     BLOCK=256)
        ln_apply_kernel[(rows, triton.cdiv(N, 4096))](
            x, self.ln.weight.contiguous(), self.ln.bias.contiguous(), stats, y, N, BLOCK=4096)
        return y
'''

# RMS norm over dim 1 of (B, F, H, W): the F values of one position are a column of a
# [F, S] tile, so one program normalises S positions in one pass.
H_RMS_NORM = KHEADER + '''

@triton.jit
def rms_norm_kernel(x_ptr, y_ptr, F, HW, eps, BF: tl.constexpr, BS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1) * BS + tl.arange(0, BS)
    f = tl.arange(0, BF)
    mask = (f[:, None] < F) & (s[None, :] < HW)
    ptrs = b * F * HW + f[:, None].to(tl.int64) * HW + s[None, :]
    x = tl.load(x_ptr + ptrs, mask=mask, other=0.0)
    rms = tl.sqrt_rn(tl.sum(x * x, axis=0) / F + eps)
    tl.store(y_ptr + ptrs, x / rms[None, :], mask=mask)


class ModelNew(nn.Module):
    def __init__(self, features, eps=1e-5):
        super().__init__()
        self.features = features
        self.eps = eps

    def forward(self, x):
        x = x.contiguous()
        B, F = x.shape[0], x.shape[1]
        HW = x.numel() // (B * F)
        y = torch.empty_like(x)
        bf = triton.next_power_of_2(F)
        bs = max(16, 4096 // bf)
        rms_norm_kernel[(B, triton.cdiv(HW, bs))](x, y, F, HW, float(self.eps), BF=bf, BS=bs)
        return y
'''

H_L2_NORM = KHEADER + '''

@triton.jit
def l2_norm_kernel(x_ptr, y_ptr, cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + base + offs, mask=offs < cols, other=0.0)
        acc += x * x
    norm = tl.sqrt_rn(tl.sum(acc, axis=0))
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(x_ptr + base + offs, mask=mask, other=0.0)
        tl.store(y_ptr + base + offs, x / norm, mask=mask)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        rows, cols = x.shape
        y = torch.empty_like(x)
        l2_norm_kernel[(rows,)](x, y, cols, BLOCK=2048)
        return y
'''

# A tiled product with float32 accumulation and IEEE float32 dot (no TF32). The epilogue
# (bias, scale, activation) is selected by constexpr flags, so Linear layers share it.
_GEMM = '''

@triton.jit
def gemm_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
                alpha, slope, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, K, BK):
        kk = k + rk
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * sam + kk[None, :] * sak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + kk[:, None].to(tl.int64) * sbk + rn[None, :] * sbn,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0)[None, :]
    acc = acc * alpha
    if ACT == 1:  # ReLU
        acc = tl.maximum(acc, 0.0)
    if ACT == 2:  # leaky ReLU
        acc = tl.where(acc >= 0, acc, acc * slope)
    tl.store(c_ptr + rm[:, None].to(tl.int64) * scm + rn[None, :] * scn, acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm(a, b, bias=None, alpha=1.0, act=0, slope=0.0):
    """a @ b (either may be a transposed view), then bias, alpha and the activation."""
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), device=a.device, dtype=torch.float32)
    grid = (triton.cdiv(M, 64), triton.cdiv(N, 64))
    gemm_kernel[grid](a, b, bias if bias is not None else c, c, M, N, K,
                      a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                      c.stride(0), c.stride(1), float(alpha), float(slope),
                      HAS_BIAS=bias is not None, ACT=act, BM=64, BN=64, BK=32)
    return c
'''

H_MATMUL = KHEADER + _GEMM + '''

class ModelNew(nn.Module):
    def forward(self, a, b):
        return gemm(a, b)
'''

H_GEMM_MUL_LEAKY = KHEADER + _GEMM + '''

class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, multiplier, slope):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.multiplier = multiplier
        self.slope = slope

    def forward(self, x):
        return gemm(x, self.gemm.weight.t(), self.gemm.bias, self.multiplier, act=2,
                    slope=self.slope)
'''

H_MLP = KHEADER + _GEMM + '''

class ModelNew(nn.Module):
    def __init__(self, in_features, hidden, out_features):
        super().__init__()
        layers = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        # Holds the weights under the reference's names; the kernel runs them.
        self.network = nn.Sequential(*layers, nn.Linear(width, out_features))

    def forward(self, x):
        linears = [m for m in self.network if isinstance(m, nn.Linear)]
        for i, lin in enumerate(linears):
            x = gemm(x, lin.weight.t(), lin.bias, act=1 if i < len(linears) - 1 else 0)
        return x
'''

# The product by the shared GEMM kernel, then one program per row: layer norm, GELU and
# the residual add in one pass over the row.
H_RESIDUAL_BLOCK = KHEADER + _GEMM + '''

@triton.jit
def norm_gelu_residual_kernel(h_ptr, x_ptr, w_ptr, b_ptr, y_ptr, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    h = tl.load(h_ptr + row * N + offs, mask=mask, other=0.0)
    mean = tl.sum(h, axis=0) / N
    d = tl.where(mask, h - mean, 0.0)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(d * d, axis=0) / N + eps)
    z = d * rstd * tl.load(w_ptr + offs, mask=mask, other=0.0) + tl.load(b_ptr + offs,
                                                                          mask=mask, other=0.0)
    g = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    x = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0)
    tl.store(y_ptr + row * N + offs, x + g, mask=mask)


class ModelNew(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        x = x.contiguous()
        h = gemm(x, self.fc.weight.t(), self.fc.bias)
        y = torch.empty_like(x)
        n = x.shape[1]
        norm_gelu_residual_kernel[(x.shape[0],)](h, x, self.norm.weight, self.norm.bias, y, n,
                                                 self.norm.eps,
                                                 BLOCK=triton.next_power_of_2(n))
        return y
'''

# sum_j (x W^T)_j = x . (sum_j W_j): the column sums of W, then one dot product per row.
H_GEMM_SUM_SCALE = KHEADER + '''

@triton.jit
def col_sum_kernel(w_ptr, out_ptr, H, I, BH: tl.constexpr, BI: tl.constexpr):
    cols = tl.program_id(0) * BI + tl.arange(0, BI)
    cmask = cols < I
    rh = tl.arange(0, BH)
    acc = tl.zeros([BH, BI], dtype=tl.float32)
    for start in range(0, H, BH):
        rows = start + rh
        m = (rows[:, None] < H) & cmask[None, :]
        acc += tl.load(w_ptr + rows[:, None].to(tl.int64) * I + cols[None, :], mask=m,
                       other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0), mask=cmask)


@triton.jit
def row_dot_kernel(x_ptr, v_ptr, out_ptr, I, scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, I, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < I
        acc += (tl.load(x_ptr + row * I + offs, mask=mask, other=0.0)
                * tl.load(v_ptr + offs, mask=mask, other=0.0))
    tl.store(out_ptr + row, tl.sum(acc, axis=0) * scale)


class ModelNew(nn.Module):
    def __init__(self, in_features, hidden, scale):
        super().__init__()
        # Only the shape matters: the reference's weights are loaded into it.
        self.weight = nn.Parameter(torch.empty(hidden, in_features))
        self.scale = scale

    def forward(self, x):
        x = x.contiguous()
        w = self.weight.contiguous()
        H, I = w.shape
        v = torch.empty(I, device=x.device, dtype=torch.float32)
        col_sum_kernel[(triton.cdiv(I, 128),)](w, v, H, I, BH=32, BI=128)
        out = torch.empty((x.shape[0], 1), device=x.device, dtype=torch.float32)
        row_dot_kernel[(x.shape[0],)](x, v, out, I, float(self.scale) / 2, BLOCK=2048)
        return out
'''

FULL_SIZE_HONEST: dict[str, str] = {
    "hinge_loss": H_HINGE_LOSS,
    "mse_loss": H_MSE_LOSS,
    "huber_loss": H_HUBER_LOSS,
    "kl_div_loss": H_KL_DIV_LOSS,
    "cosine_loss": H_COSINE_LOSS,
    "triplet_loss": H_TRIPLET_LOSS,
    "cross_entropy": H_CROSS_ENTROPY,
    "sum_dim": H_SUM_DIM,
    "mean_dim": H_MEAN_DIM,
    "max_dim": H_MAX_DIM,
    "argmax_dim": H_ARGMAX_DIM,
    "max_with_index": H_MAX_WITH_INDEX,
    "softmax": H_SOFTMAX,
    "log_softmax": H_LOG_SOFTMAX,
    "relu": H_RELU,
    "gelu": H_GELU,
    "sigmoid": H_SIGMOID,
    "leaky_relu": H_LEAKY_RELU,
    "tanh": H_TANH,
    "softplus": H_SOFTPLUS,
    "threshold_mask": H_THRESHOLD_MASK,
    "layer_norm": H_LAYER_NORM,
    "rms_norm": H_RMS_NORM,
    "l2_norm": H_L2_NORM,
    "matmul": H_MATMUL,
    "gemm_mul_leaky": H_GEMM_MUL_LEAKY,
    "gemm_sum_scale": H_GEMM_SUM_SCALE,
    "mlp": H_MLP,
    "residual_block": H_RESIDUAL_BLOCK,
}

# ---- cheats --------------------------------------------------------------------------------

_COPY = '''

@triton.jit
def copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


def copy(x):
    y = torch.empty_like(x)
    copy_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), BLOCK=4096)
    return y
'''

# Right once (an honest product), then served from a memo keyed on what the timing loop
# keeps fixed: the inputs' storage and shape. A fresh copy each call, so
# no output aliases an earlier one.
C_MEMO_MATMUL = KHEADER + _GEMM + _COPY + '''

_memo = {}


def _key(t):
    return (t.data_ptr(), tuple(t.shape))


class ModelNew(nn.Module):
    def forward(self, a, b):
        key = (_key(a), _key(b))
        if key not in _memo:
            if len(_memo) > 8:
                _memo.clear()
            _memo[key] = gemm(a, b)
        return copy(_memo[key])
'''

# A copy is ReLU on non-negative inputs only.
C_COPY_RELU = KHEADER + _COPY + '''

class ModelNew(nn.Module):
    def forward(self, x):
        return copy(x.contiguous())
'''

# name -> (problem, candidate source, the check(s) that must catch it; "|" separates
# alternatives). The memo is caught when a timed call's fresh input lands in a freed input's
# block (same data_ptr, version 0, shape) and gets the stale product; the same can happen
# between two input sets of the correctness stage, which then catches it first.
FULL_SIZE_CHEATS: dict[str, tuple[str, str, str]] = {
    # On the H200 (2026-12-01) the full-size memo was caught by the physical floor: its
    # timed calls met input addresses it had seen, so the memo served them (a copy, 0.034
    # ms against a 0.174 ms floor).
    "memo_matmul": ("matmul", C_MEMO_MATMUL, "timed_output|rel_norm|elementwise|physical_floor"),
    "copy_relu": ("relu", C_COPY_RELU, "rel_norm|elementwise"),
}


def input_bytes(problem: SizedProblem, full: bool = True) -> int:
    """Bytes of the problem's inputs at a size, from shapes alone (meta tensors)."""
    import torch

    namespace: dict[str, Any] = {}
    with torch.device("meta"):
        exec(problem.source(full), namespace)
        inputs = namespace["get_inputs"]()
    return sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))
