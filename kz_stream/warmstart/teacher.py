"""The Triton teacher: lowers a synthesized module to the Coder's answer format.

``lower(source)`` reads a module in the synthesizer's form (one ``x = <call>`` line per
op in ``forward``), recognises each line as one of ``kz_stream.warmstart.ops``, and writes
one self-contained file: ``@triton.jit`` kernels and a ``ModelNew`` with the same
``__init__`` (so the same seed gives the same parameters) that launches them. Elementwise
chains become one flat kernel; anything with a whole-row op or a reduction becomes one
program per row; a matmul becomes a tiled ``tl.dot`` kernel with the elementwise ops after
it fused into its epilogue (and a row kernel for what follows).

Why not TorchInductor: its Triton comes out only on a GPU (its CPU backend emits C++), in
files of 200-600 lines tied to ``torch._inductor`` runtime helpers. These kernels are
short, written the way the Coder's prompt example is, and run under the Triton
interpreter, so the whole warm-start data path runs and is tested on a CPU.

``TeacherBackend`` serves ``lower`` as an ``LLMBackend``, so ``kz eval run --policy
teacher`` stores and verifies teacher kernels exactly as it does a model's.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass

from kz_stream.llm import LLMBackend, Prompt, Sample, SamplingParams
from kz_stream.modules import extract_code, fence_code
from kz_stream.warmstart.ops import OPS, Op

__all__ = ["TeacherBackend", "TeacherError", "lower"]

_IND = "    "


class TeacherError(ValueError):
    """The module is not in a form the teacher can lower."""


@dataclass(frozen=True)
class _Step:
    op: Op
    y: str  # the second input's name (binary ops, torch.matmul)
    attr: str  # the nn module attribute, if any


@dataclass(frozen=True)
class _Parsed:
    init: str  # the __init__ definition, verbatim
    args: list[str]
    steps: list[_Step]


def _norm(expr: str) -> str:
    return ast.unparse(ast.parse(expr, mode="eval"))


def _parse(source: str) -> _Parsed:
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise TeacherError(f"syntax error: {e.msg}") from e
    model = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model"),
                 None)
    if model is None:
        raise TeacherError("no class Model")
    funcs = {n.name: n for n in model.body if isinstance(n, ast.FunctionDef)}
    if "__init__" not in funcs or "forward" not in funcs:
        raise TeacherError("Model has no __init__ or forward")
    init = ast.get_source_segment(source, funcs["__init__"])
    forward = funcs["forward"]
    args = [a.arg for a in forward.args.args[1:]]
    # attribute -> the callable that built it ("nn.LayerNorm")
    attrs = {
        t.attr: ast.unparse(node.value.func)
        for node in ast.walk(funcs["__init__"])
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        for t in node.targets
        if isinstance(t, ast.Attribute)
    }
    steps: list[_Step] = []
    for stmt in forward.body:
        if isinstance(stmt, ast.Return):
            if not (isinstance(stmt.value, ast.Name) and stmt.value.id == "x"):
                raise TeacherError("forward must end with `return x`")
            break
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id == "x"):
            raise TeacherError(f"line {stmt.lineno}: not of the form `x = <call>`")
        steps.append(_match(ast.unparse(stmt.value), args, attrs))
    if not steps:
        raise TeacherError("forward applies no operation")
    if args[:1] != ["x"]:
        raise TeacherError("forward's first input must be x")
    if init is None:
        raise TeacherError("cannot read __init__")
    return _Parsed(init, args, steps)


def _match(expr: str, args: Sequence[str], attrs: dict[str, str]) -> _Step:
    wanted = _norm(expr)
    for op in OPS:
        ctor = op.module.split("(")[0] if op.module else None
        for y in [a for a in args if a != "x"] or [""]:
            for attr in [a for a, c in attrs.items() if c == ctor] if ctor else [""]:
                rendered = op.torch.format(x="x", y=y, m=attr)
                if _norm(rendered) == wanted:
                    return _Step(op, y if "{y}" in op.torch else "", attr)
    raise TeacherError(f"no lowering for `{expr}`")


def _indent(code: str, depth: int = 1) -> list[str]:
    return [_IND * depth + line if line else "" for line in code.splitlines()]


def _lowering(step: _Step) -> str:
    if step.op.triton is None:  # _match reads OPS only, whose ops all have one
        raise TeacherError(f"no lowering for {step.op.api}")
    return step.op.triton


def _elementwise(step: _Step) -> str:
    return f"x = {_lowering(step).format(y=step.y)}"


def _row_statement(step: _Step) -> str:
    if step.op.kind in ("unary", "binary"):
        return _elementwise(step)
    return _lowering(step).format(p=f"{step.attr}_" if step.attr else "")


def _param_args(steps: Sequence[_Step]) -> tuple[list[str], list[str]]:
    """Kernel parameter names and the forward expressions passed for them."""
    names: list[str] = []
    values: list[str] = []
    for s in steps:
        if s.op.kind in ("rowmap", "reduce") and s.attr:
            for p in s.op.params:
                names.append(f"{s.attr}_{p}" if p == "eps" else f"{s.attr}_{p}_ptr")
                values.append(f"self.{s.attr}.{p}")
    return names, values


def _inputs(steps: Sequence[_Step]) -> list[str]:
    seen: list[str] = []
    for s in steps:
        if s.op.kind == "binary" and s.y not in seen:
            seen.append(s.y)
    return seen


def _flat_kernel(steps: Sequence[_Step]) -> tuple[str, list[str]]:
    ys = _inputs(steps)
    sig = ", ".join(["x_ptr", *(f"{y}_ptr" for y in ys), "out_ptr", "n_elements",
                     "BLOCK_SIZE: tl.constexpr"])
    body = ["pid = tl.program_id(axis=0)",
            "offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)",
            "mask = offsets < n_elements",
            "x = tl.load(x_ptr + offsets, mask=mask)",
            *(f"{y} = tl.load({y}_ptr + offsets, mask=mask)" for y in ys),
            *(_elementwise(s) for s in steps),
            "tl.store(out_ptr + offsets, x, mask=mask)"]
    kernel = ["@triton.jit", f"def fused_kernel({sig}):", *_indent("\n".join(body))]
    fwd = ["x = x.contiguous()", *(f"{y} = {y}.contiguous()" for y in ys),
           "out = torch.empty_like(x)",
           "n_elements = x.numel()",
           "grid = (triton.cdiv(n_elements, 1024),)",
           f"fused_kernel[grid]({', '.join(['x', *ys, 'out', 'n_elements'])}, BLOCK_SIZE=1024)",
           "return out"]
    return "\n".join(kernel), fwd


def _row_kernel(steps: Sequence[_Step], source: str) -> tuple[str, list[str]]:
    ys = _inputs(steps)
    pnames, pvalues = _param_args(steps)
    reduces = any(s.op.kind == "reduce" for s in steps)
    sig = ", ".join(["x_ptr", *(f"{y}_ptr" for y in ys), *pnames, "out_ptr", "n_cols",
                     "BLOCK_SIZE: tl.constexpr"])
    body = ["row = tl.program_id(axis=0)",
            "cols = tl.arange(0, BLOCK_SIZE)",
            "mask = cols < n_cols",
            "x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)",
            *(f"{y} = tl.load({y}_ptr + row * n_cols + cols, mask=mask, other=0.0)"
              for y in ys),
            *(_row_statement(s) for s in steps),
            "tl.store(out_ptr + row, x)" if reduces
            else "tl.store(out_ptr + row * n_cols + cols, x, mask=mask)"]
    kernel = ["@triton.jit", f"def row_kernel({sig}):", *_indent("\n".join(body))]
    out = ("torch.empty(x.shape[:-1], device=x.device, dtype=x.dtype)" if reduces
           else "torch.empty_like(x)")
    fwd = [f"{source} = {source}.contiguous()" if source == "x" else f"x = {source}",
           *(f"{y} = {y}.contiguous()" for y in ys),
           "n_cols = x.shape[-1]",
           "n_rows = x.numel() // n_cols",
           f"out = {out}",
           "BLOCK_SIZE = triton.next_power_of_2(n_cols)",
           f"row_kernel[(n_rows,)]({', '.join(['x', *ys, *pvalues, 'out', 'n_cols'])}, "
           "BLOCK_SIZE=BLOCK_SIZE)",
           "return out"]
    return "\n".join(kernel), fwd


def _matmul_kernel(mm: _Step, steps: Sequence[_Step]) -> tuple[str, list[str]]:
    ys = _inputs(steps)
    bias = mm.op.module is not None and "bias" in mm.op.params
    sig = ", ".join(["a_ptr", "b_ptr", *(["bias_ptr"] if bias else []),
                     *(f"{y}_ptr" for y in ys), "c_ptr", "M", "N", "K",
                     "stride_am", "stride_ak", "stride_bk", "stride_bn",
                     "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr", "BLOCK_K: tl.constexpr"])
    body = ["pid_m = tl.program_id(axis=0)",
            "pid_n = tl.program_id(axis=1)",
            "rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
            "rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
            "rk = tl.arange(0, BLOCK_K)",
            "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
            "for k0 in range(0, K, BLOCK_K):",
            "    ks = k0 + rk",
            "    a = tl.load(a_ptr + rm[:, None] * stride_am + ks[None, :] * stride_ak,",
            "                mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)",
            "    b = tl.load(b_ptr + ks[:, None] * stride_bk + rn[None, :] * stride_bn,",
            "                mask=(ks[:, None] < K) & (rn[None, :] < N), other=0.0)",
            # IEEE fp32 products: TF32 would fail the verifier's float32 tolerance.
            '    acc += tl.dot(a, b, input_precision="ieee")',
            "x = acc",
            *(["x = x + tl.load(bias_ptr + rn, mask=rn < N, other=0.0)[None, :]"]
              if bias else []),
            "c_mask = (rm[:, None] < M) & (rn[None, :] < N)",
            *(f"{y} = tl.load({y}_ptr + rm[:, None] * N + rn[None, :], mask=c_mask, other=0.0)"
              for y in ys),
            *(_elementwise(s) for s in steps),
            "tl.store(c_ptr + rm[:, None] * N + rn[None, :], x, mask=c_mask)"]
    kernel = ["@triton.jit", f"def matmul_kernel({sig}):", *_indent("\n".join(body))]
    if mm.attr:  # nn.Linear: weight is [N, K], read transposed through its strides
        b_setup = [f"b = self.{mm.attr}.weight", "N = b.shape[0]"]
        b_strides = "b.stride(1), b.stride(0)"
        bias_arg = [f"self.{mm.attr}.bias"] if bias else []
    else:
        b_setup = [f"b = {mm.y}.contiguous()", "N = b.shape[1]"]
        b_strides = "b.stride(0), b.stride(1)"
        bias_arg = []
    fwd = ["x = x.contiguous()", *b_setup, *(f"{y} = {y}.contiguous()" for y in ys),
           "M, K = x.shape",
           "c = torch.empty((M, N), device=x.device, dtype=x.dtype)",
           "grid = (triton.cdiv(M, 64), triton.cdiv(N, 64))",
           f"matmul_kernel[grid]({', '.join(['x', 'b', *bias_arg, *ys, 'c'])}, M, N, K,",
           f"                    x.stride(0), x.stride(1), {b_strides},",
           "                    BLOCK_M=64, BLOCK_N=64, BLOCK_K=32)"]
    return "\n".join(kernel), fwd


def lower(source: str) -> str:
    """The teacher's answer for a synthesized module: a whole file with ``ModelNew``.

    Raises ``TeacherError`` for a module not in the synthesizer's form.
    """
    parsed = _parse(source)
    steps = parsed.steps
    kernels: list[str] = []
    fwd: list[str] = []
    if steps[0].op.kind == "matmul":
        if any(s.op.kind == "matmul" for s in steps[1:]):
            raise TeacherError("more than one matmul")
        rest = steps[1:]
        cut = next((i for i, s in enumerate(rest) if s.op.kind in ("rowmap", "reduce")),
                   len(rest))
        kernel, fwd = _matmul_kernel(steps[0], rest[:cut])
        kernels.append(kernel)
        if cut < len(rest):
            kernel, row_fwd = _row_kernel(rest[cut:], "c")
            kernels.append(kernel)
            fwd += row_fwd
        else:
            fwd.append("return c")
    elif any(s.op.kind == "matmul" for s in steps):
        raise TeacherError("a matmul must come first")
    elif any(s.op.kind in ("rowmap", "reduce") for s in steps):
        kernel, fwd = _row_kernel(steps, "x")
        kernels.append(kernel)
    else:
        kernel, fwd = _flat_kernel(steps)
        kernels.append(kernel)
    init = parsed.init.splitlines()
    sig = ", ".join(f"{a}: torch.Tensor" for a in parsed.args)
    lines = ["import torch", "import torch.nn as nn", "import triton",
             "import triton.language as tl", ""]
    for k in kernels:
        lines += ["", k, ""]
    lines += ["", "class ModelNew(nn.Module):", _IND + init[0].strip(), *init[1:], "",
              f"    def forward(self, {sig}) -> torch.Tensor:", *_indent("\n".join(fwd), 2)]
    return "\n".join(lines) + "\n"


def _module_of(prompt: Prompt) -> str:
    if isinstance(prompt, str):
        text = prompt
    else:
        text = next(m["content"] for m in reversed(prompt) if m["role"] == "user")
    code = extract_code(text, require="class Model")
    if code is None:
        raise TeacherError("the prompt holds no module")
    return code


class TeacherBackend(LLMBackend):
    """The teacher as a policy: answers each Coder prompt with ``lower`` of its module.

    A module it cannot lower gets a reply without code (so its verdict says no kernel was
    found); it returns no token ids, like a hosted model, so it is for evaluation and data.
    """

    @property
    def policy_version(self) -> int:
        return 0

    async def generate(
        self, prompts: Sequence[Prompt], *, n: int = 1, sampling: SamplingParams
    ) -> list[list[Sample]]:
        out: list[list[Sample]] = []
        for prompt in prompts:
            try:
                text = fence_code(lower(_module_of(prompt)))
            except TeacherError as e:
                text = f"The teacher has no kernel for this module: {e}."
            out.append([Sample(text, [], [], "stop", 0) for _ in range(n)])
        return out

    async def load_policy(self, version: int, uri: str, *, kind: str = "lora") -> None:
        raise NotImplementedError("the teacher has no weights to load")

    async def close(self) -> None:
        return None
