"""Static scan of a candidate for falling back to the torch ops it should replace, and for
threads, streams, timers, introspection and monkeypatching.

Names are resolved, not matched as text: the scan follows imports and assignments
(``f = torch.nn.functional``), folds constant ``getattr`` names (``getattr(f, "re" +
"lu")``), and treats ``getattr`` on a torch namespace with a name it cannot fold as
obfuscation. The C++ of CUDA candidates is scanned for ``torch::``/``at::`` calls,
side streams, threads and process control. The run-time checks (a dispatch-mode op log
and the profiler) back this up where static analysis cannot see.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

from kz_stream.verify._rewrite import strip_cpp_comments

__all__ = ["Finding", "canonical_op", "reference_ops", "scan"]


@dataclass(frozen=True)
class Finding:
    """One rule that fired: its id, a message and the 1-based line (0 if unknown)."""

    rule: str
    message: str
    line: int = 0


# Ops that only view, allocate or move data: a candidate may call these freely.
BENIGN_OPS = frozenset({
    # Random tensors: how parameters are initialised (a KernelBench reference's
    # ``nn.Parameter(torch.randn(shape))``), not the computation being replaced; a
    # candidate that initialises its own the same way was judged a fallback (kzv-1.3).
    "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
    "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like",
    "full", "full_like", "new_empty", "new_zeros", "new_ones", "new_full", "arange",
    "tensor", "as_tensor", "from_numpy", "view", "reshape", "contiguous", "clone", "copy",
    "detach", "to", "cuda", "cpu", "float", "half", "double", "bfloat16", "int", "long",
    "size", "dim", "numel", "stride", "t", "transpose", "permute", "expand", "expand_as",
    "unsqueeze", "squeeze", "flatten", "unflatten", "view_as", "reshape_as", "narrow",
    "select", "slice", "split", "chunk", "as_strided", "is_contiguous", "data_ptr",
    "item", "tolist", "numpy", "type", "element_size", "fill", "zero", "requires_grad",
    "_to_copy", "alias", "lift_fresh", "unbind", "stack", "cat", "device", "dtype",
    "manual_seed", "no_grad", "is_cuda", "get_device", "storage_offset", "set_grad_enabled",
    "inference_mode", "is_floating_point", "empty_cache", "synchronize", "current_device",
    "current_stream", "device_count", "is_available", "get_device_properties", "cdiv",
    "parameters", "register_buffer", "register_parameter", "parameter", "set",
    "resize", "record_stream", "is_same_size", "sym_size", "sym_stride", "sym_numel",
})

_SYNONYMS: dict[str, str] = {}
for _canon, _names in {
    "matmul": ("mm", "bmm", "matmul", "addmm", "linear", "einsum", "tensordot", "baddbmm",
               "addbmm", "dot", "mv", "addmv", "__matmul__", "inner", "outer", "bilinear"),
    "conv": ("conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d",
             "conv_transpose2d", "conv_transpose3d", "_convolution", "cudnn_convolution",
             "conv_tbc"),
    "softmax": ("softmax", "_softmax", "_safe_softmax"),
    "log_softmax": ("log_softmax", "_log_softmax"),
    "layer_norm": ("layer_norm", "native_layer_norm", "layernorm"),
    "group_norm": ("group_norm", "native_group_norm", "groupnorm"),
    "batch_norm": ("batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                   "cudnn_batch_norm", "batchnorm1d", "batchnorm2d", "batchnorm3d",
                   "_batch_norm_impl_index", "batchnorm"),
    "instance_norm": ("instance_norm", "instancenorm1d", "instancenorm2d", "instancenorm3d"),
    "max_pool": ("max_pool1d", "max_pool2d", "max_pool3d", "maxpool1d", "maxpool2d",
                 "maxpool3d", "max_pool2d_with_indices", "max_pool3d_with_indices"),
    "avg_pool": ("avg_pool1d", "avg_pool2d", "avg_pool3d", "avgpool1d", "avgpool2d",
                 "avgpool3d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d",
                 "adaptiveavgpool2d", "adaptive_avg_pool1d", "adaptiveavgpool1d"),
    "scaled_dot_product_attention": ("scaled_dot_product_attention",
                                     "_scaled_dot_product_flash_attention",
                                     "_scaled_dot_product_efficient_attention",
                                     "_scaled_dot_product_cudnn_attention"),
    "gelu": ("gelu",),
    "relu": ("relu", "threshold"),
    "add": ("add", "__add__", "__radd__", "__iadd__"),
    "mul": ("mul", "__mul__", "__rmul__", "__imul__", "multiply"),
    "sub": ("sub", "__sub__", "__rsub__", "rsub", "subtract"),
    "div": ("div", "__truediv__", "__rtruediv__", "divide", "true_divide"),
}.items():
    for _n in _names:
        _SYNONYMS[_n] = _canon

# Arithmetic that a fused kernel's host code legitimately does on scalars or small
# tensors: never treated as falling back, even when the reference uses it.
_ARITHMETIC = frozenset({"add", "mul", "sub", "div", "neg", "pow", "abs"})


def canonical_op(name: str) -> str:
    """The op family of a torch function, method, aten op or nn module class name."""
    n = name.split(".")[-1]
    if n.startswith("aten::"):
        n = n[6:]
    if not n.startswith("__"):
        n = n.rstrip("_")
    n = n.lower()
    return _SYNONYMS.get(n, n)


# ---- name resolution ---------------------------------------------------------------------

_TORCH_ROOTS = ("torch", "triton")


class _Resolver(ast.NodeVisitor):
    """Tracks which local names stand for torch modules, functions and classes."""

    def __init__(self) -> None:
        self.env: dict[str, str] = {}
        self.findings: list[Finding] = []
        self.torch_calls: list[tuple[str, int]] = []  # (qualified name, line)
        self.method_calls: list[tuple[str, int]] = []
        self.consts: dict[str, str] = {}
        self.instances: dict[str, str] = {}  # self.<attr> -> torch.nn class it holds
        self.instance_calls: list[tuple[str, int]] = []

    # -- expression evaluation

    def const_str(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return self.consts.get(node.id)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            a, b = self.const_str(node.left), self.const_str(node.right)
            return a + b if a is not None and b is not None else None
        if isinstance(node, ast.JoinedStr):
            parts = []
            for v in node.values:
                s = self.const_str(v.value) if isinstance(v, ast.FormattedValue) else (
                    self.const_str(v))
                if s is None:
                    return None
                parts.append(s)
            return "".join(parts)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "join" and len(node.args) == 1):
            sep = self.const_str(node.func.value)
            arg = node.args[0]
            if sep is not None and isinstance(arg, ast.List | ast.Tuple):
                items = [self.const_str(e) for e in arg.elts]
                if all(i is not None for i in items):
                    return sep.join(i for i in items if i is not None)
        return None

    def qualname(self, node: ast.AST) -> str | None:
        """The torch path an expression denotes (e.g. "torch.nn.functional.relu")."""
        if isinstance(node, ast.Name):
            return self.env.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.qualname(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "getattr" and len(node.args) >= 2:
                base = self.qualname(node.args[0])
                if base is None:
                    return None
                name = self.const_str(node.args[1])
                if name is None:
                    self.findings.append(Finding(
                        "obfuscated_access", f"getattr on {base} with a computed name",
                        node.lineno))
                    return None
                return f"{base}.{name}"
            if node.func.id == "__import__" and node.args:
                name = self.const_str(node.args[0])
                if name and name.split(".")[0] in _TORCH_ROOTS:
                    return name.split(".")[0]
        if isinstance(node, ast.Call):
            inner = self.qualname(node.func)
            if inner in ("importlib.import_module",) and node.args:
                return self.const_str(node.args[0])
        return None

    # -- statements

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            root = a.name.split(".")[0]
            if a.asname:
                self.env[a.asname] = a.name
            else:
                self.env[root] = root
            _check_module(a.name, node.lineno, self.findings)
            if root == "importlib":
                self.env[a.asname or root] = "importlib"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        _check_module(mod, node.lineno, self.findings)
        for a in node.names:
            self.env[a.asname or a.name] = f"{mod}.{a.name}"
            _check_module(f"{mod}.{a.name}", node.lineno, self.findings)

    def visit_Assign(self, node: ast.Assign) -> None:
        self._assign(node.targets, node.value, node.lineno)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._assign([node.target], node.value, node.lineno)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_store(node.target, node.lineno)
        self.generic_visit(node)

    def _assign(self, targets: list[ast.expr], value: ast.expr, line: int) -> None:
        q = self.qualname(value)
        s = self.const_str(value)
        if isinstance(value, ast.Call):
            cls = self.qualname(value.func)
            if cls and cls.split(".")[-1][:1].isupper():
                for t in targets:
                    if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                            and t.value.id == "self"):
                        self.instances[t.attr] = cls
        for t in targets:
            self._check_store(t, line)
            if isinstance(t, ast.Name):
                if q:
                    self.env[t.id] = q
                elif t.id in self.env:
                    del self.env[t.id]
                if s is not None:
                    self.consts[t.id] = s

    def _check_store(self, target: ast.expr, line: int) -> None:
        """Assigning to an attribute of torch, time or a module is monkeypatching."""
        if isinstance(target, ast.Attribute):
            owner = self.qualname(target.value)
            if owner and owner.split(".")[0] in ("torch", "time", "triton", "builtins", "sys",
                                                 "kz_stream", "os", "threading", "gc"):
                path = f"{owner}.{target.attr}"
                if path.startswith("os.environ"):
                    return
                rule = "precision" if "tf32" in target.attr or "reduced_precision" in (
                    target.attr) else "monkeypatch"
                self.findings.append(Finding(rule, f"assigns {path}", line))
        elif isinstance(target, ast.Tuple | ast.List):
            for e in target.elts:
                self._check_store(e, line)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                and f.value.id == "self" and f.attr in self.instances):
            self.instance_calls.append((self.instances[f.attr], node.lineno))
        q = self.qualname(node.func)
        if q:
            self.torch_calls.append((q, node.lineno))
            _check_call(q, node, self)
        elif isinstance(node.func, ast.Attribute):
            self.method_calls.append((node.func.attr, node.lineno))
            if node.func.attr in ("__setattr__",) or (node.func.attr == "update" and isinstance(
                    node.func.value, ast.Attribute) and node.func.value.attr == "__dict__"):
                self.findings.append(Finding("monkeypatch", "sets attributes dynamically",
                                             node.lineno))
        elif isinstance(node.func, ast.Name):
            _check_builtin(node.func.id, node, self)
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if isinstance(node.op, ast.MatMult):
            self.method_calls.append(("__matmul__", node.lineno))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in _INTROSPECTION_ATTRS:
            self.findings.append(Finding("introspection", f"uses .{node.attr}", node.lineno))
        q = self.qualname(node)
        if q and not isinstance(getattr(node, "ctx", None), ast.Store):
            # A torch function referenced without a call (passed or stored) still counts.
            self.torch_calls.append((q, node.lineno))
        self.generic_visit(node)


_INTROSPECTION_ATTRS = frozenset({
    "__subclasses__", "__globals__", "__code__", "__closure__", "__builtins__", "f_back",
    "f_globals", "f_locals", "gi_frame", "tb_frame", "__mro__", "__bases__", "__dict__",
    "_getframe", "modules", "settrace", "setprofile", "__class__",
})

_FORBIDDEN_MODULES = {
    "threading": "thread", "_thread": "thread", "concurrent": "thread",
    "multiprocessing": "subprocess", "subprocess": "subprocess", "asyncio": "thread",
    "signal": "timer", "sched": "timer", "ctypes": "native_access", "cffi": "native_access",
    "gc": "introspection", "inspect": "introspection", "traceback": "introspection",
    "builtins": "monkeypatch", "importlib": "dynamic_code", "socket": "network",
    "urllib": "network", "http": "network", "requests": "network", "pickle": "file_io",
    "shelve": "file_io", "tempfile": "file_io", "shutil": "file_io", "pathlib": "file_io",
    "mmap": "file_io", "atexit": "timer", "weakref": "timer", "sys": "introspection",
    "unittest": "monkeypatch", "torch._dynamo": "torch_compile",
    "torch._inductor": "torch_compile", "kz_stream": "introspection",
    "torch.profiler": "timer", "torch.autograd.profiler": "timer",
    "torch.cuda.graphs": "stream", "torch.multiprocessing": "subprocess",
}


def _check_module(name: str, line: int, findings: list[Finding]) -> None:
    for mod, rule in _FORBIDDEN_MODULES.items():
        if name == mod or name.startswith(mod + "."):
            findings.append(Finding(rule, f"imports {name}", line))
            return


_FORBIDDEN_CALLS = {
    "torch.cuda.Stream": "stream", "torch.cuda.stream": "stream",
    "torch.cuda.set_stream": "stream", "torch.cuda.ExternalStream": "stream",
    "torch.Stream": "stream", "torch.cuda.graph": "stream", "torch.cuda.CUDAGraph": "stream",
    "torch.cuda.Event": "timer", "torch.cuda.set_sync_debug_mode": "monkeypatch",
    "torch.compile": "torch_compile", "torch.jit.script": "torch_compile",
    "torch.jit.trace": "torch_compile", "torch.set_float32_matmul_precision": "precision",
    "torch.backends.cudnn.allow_tf32": "precision", "torch.set_default_dtype": "precision",
    "torch.cuda.set_per_process_memory_fraction": "monkeypatch",
    "torch.utils.cpp_extension.load": "native_access",
    "torch.ops.load_library": "native_access", "torch.library.Library": "monkeypatch",
    "torch.library.impl": "monkeypatch", "torch.overrides": "monkeypatch",
    "os.system": "subprocess", "os.popen": "subprocess", "os.fork": "subprocess",
    "os.kill": "subprocess", "os.execv": "subprocess", "os.spawnv": "subprocess",
    "os.posix_spawn": "subprocess", "os.remove": "file_io", "os.unlink": "file_io",
    "os.rename": "file_io", "os.makedirs": "file_io", "os.mkdir": "file_io",
    "os.chdir": "file_io", "os.sched_setaffinity": "monkeypatch",
    "time.sleep": "timer", "time.perf_counter": "timer", "time.time": "timer",
    "time.monotonic": "timer", "time.process_time": "timer",
    "triton.testing.do_bench": "timer",
}

_FORBIDDEN_BUILTINS = {
    "exec": "dynamic_code", "eval": "dynamic_code", "compile": "dynamic_code",
    "__import__": "dynamic_code", "globals": "introspection", "locals": "introspection",
    "vars": "introspection", "setattr": "monkeypatch", "delattr": "monkeypatch",
    "open": "file_io", "breakpoint": "introspection", "memoryview": "native_access",
}


def _check_call(q: str, node: ast.Call, r: _Resolver) -> None:
    if q.endswith(("__setattr__", "__delattr__")):
        r.findings.append(Finding("monkeypatch", f"calls {q}", node.lineno))
        return
    for name, rule in _FORBIDDEN_CALLS.items():
        if q == name or q.startswith(name + "."):
            r.findings.append(Finding(rule, f"calls {q}", node.lineno))
            return
    if q.startswith("os.exec") or q.startswith("os.spawn"):
        r.findings.append(Finding("subprocess", f"calls {q}", node.lineno))


def _check_builtin(name: str, node: ast.Call, r: _Resolver) -> None:
    rule = _FORBIDDEN_BUILTINS.get(name)
    if rule is None:
        return
    if name == "setattr" and node.args:
        # setattr(self, ...) inside a module's own methods is ordinary Python.
        target = node.args[0]
        if isinstance(target, ast.Name) and target.id == "self":
            return
    r.findings.append(Finding(rule, f"calls {name}()", node.lineno))


# ---- C++ scan ------------------------------------------------------------------------------

_CPP_RULES: list[tuple[re.Pattern[str], str, str]] = [
    (re.compile(r"\bcudaStreamCreate\w*|\bgetStreamFromPool\b|\bcudaStreamNonBlocking\b"),
     "stream", "creates a CUDA stream"),
    (re.compile(r"\bstd::thread\b|\bpthread_create\b|\bstd::async\b|\bstd::jthread\b"),
     "thread", "starts a host thread"),
    (re.compile(r"\bfork\s*\(|\bpopen\s*\(|\bsystem\s*\(|\bexecv\w*\s*\(|\bdlopen\s*\("),
     "subprocess", "process control or dynamic loading"),
    (re.compile(r"\bcudaEventElapsedTime\b|\bcudaLaunchHostFunc\b|\bcudaStreamAddCallback\b"),
     "timer", "timing or host callbacks"),
    (re.compile(r"\bcublas\w*|\bcudnn\w*|\bcutlass::"), "library_fallback",
     "calls cuBLAS/cuDNN/CUTLASS"),
    (re.compile(r"\bPy_\w+|\bPyObject\b|\bpybind11::module_::import\b|\bpy::module::import\b"),
     "introspection", "calls into Python from C++"),
]
_CPP_TORCH_CALL = re.compile(r"\b(?:torch|at)::(?:native::|cuda::|nn::functional::)?(\w+)\s*\(")


def _scan_cpp(sources: Iterable[str], ref_ops: frozenset[str]) -> list[Finding]:
    findings: list[Finding] = []
    for src in sources:
        clean = strip_cpp_comments(src)
        for pat, rule, msg in _CPP_RULES:
            m = pat.search(clean)
            if m:
                findings.append(Finding(rule, f"C++ {msg} ({m.group(0)})"))
        for m in _CPP_TORCH_CALL.finditer(clean):
            op = canonical_op(m.group(1))
            if op in ref_ops and op not in BENIGN_OPS and op not in _ARITHMETIC:
                findings.append(Finding("torch_fallback",
                                        f"C++ calls torch op {m.group(0).rstrip('(')}"))
    return findings


def string_constants(tree: ast.AST) -> list[str]:
    """Every string literal in ``tree`` (where embedded C++ and CUDA sources live)."""
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)]


# ---- public entry points -----------------------------------------------------------------


@functools.lru_cache(maxsize=256)  # a group brings many candidates per problem
def reference_ops(reference_source: str) -> frozenset[str]:
    """Canonical names of the compute ops a reference module calls (statically)."""
    try:
        tree = ast.parse(reference_source)
    except SyntaxError:
        return frozenset()
    r = _Resolver()
    for stmt in tree.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name in ("get_inputs", "get_init_inputs"):
            continue
        r.visit(stmt)
    ops = {canonical_op(q) for q, _ in r.torch_calls}
    ops |= {canonical_op(m) for m, _ in r.method_calls}
    return frozenset(o for o in ops if o not in BENIGN_OPS and not o.startswith("_"))


def scan(candidate_source: str, ref_ops: Iterable[str] = ()) -> list[Finding]:
    """Findings for a candidate; ``ref_ops`` are the canonical ops it must not fall back to
    (from ``reference_ops`` or the reference's run-time op log)."""
    try:
        tree = ast.parse(candidate_source)
    except SyntaxError as e:
        return [Finding("syntax", f"does not parse: {e.msg}", e.lineno or 0)]
    refs = frozenset(canonical_op(o) for o in ref_ops)
    r = _Resolver()
    r.visit(tree)
    findings = list(r.findings)
    for q, line in r.torch_calls + [(f"{q}()", line) for q, line in r.instance_calls]:
        root = q.split(".")[0]
        if root != "torch":
            continue
        called_instance = q.endswith("()")
        q = q.removesuffix("()")
        if q.split(".")[-1][:1].isupper() and not called_instance:
            continue  # building an nn module (to hold parameters) is not running it
        op = canonical_op(q)
        if op in refs and op not in BENIGN_OPS and op not in _ARITHMETIC and not _is_namespace(q):
            findings.append(Finding("torch_fallback", f"uses {q} (the reference's {op})", line))
    for m, line in r.method_calls:
        op = canonical_op(m)
        if op in refs and op not in BENIGN_OPS and op not in _ARITHMETIC:
            findings.append(Finding("torch_fallback", f"calls .{m}() (the reference's {op})",
                                    line))
    findings += _scan_cpp([t for t in string_constants(tree) if "\n" in t], refs)
    seen: set[tuple[str, str]] = set()
    unique = []
    for f in findings:
        if (f.rule, f.message) not in seen:
            seen.add((f.rule, f.message))
            unique.append(f)
    return unique


def _is_namespace(q: str) -> bool:
    return q in ("torch", "torch.nn", "torch.nn.functional", "torch.ops", "torch.ops.aten",
                 "torch.cuda", "torch.Tensor", "torch.nn.Module")
