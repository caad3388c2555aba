"""CUDA builds for ``load_inline`` candidates: parallel CPU compiles ahead of the GPU stage,
a content-addressed cache, and a faster translation unit than ``load_inline`` builds.

``load_inline`` compiles two translation units, a pybind ``main.cpp`` (all of
``torch/extension.h``) and ``cuda.cu`` (usually ``torch/extension.h`` again), each parsing
the torch headers two or three times (host preprocess, ``cudafe++``, ``cicc``, host
``gcc``). The fast layout builds one ``.cu`` instead:

- the user's functions are registered with ``TORCH_LIBRARY`` (``torch/library.h``, far
  lighter than pybind and ``torch/extension.h``), through generated wrappers that widen
  ``int``/``float`` parameters to the ``int64_t``/``double`` an operator schema needs;
  the worker hands the candidate an object whose attributes call ``torch.ops``;
- ``torch/extension.h`` becomes ``torch/types.h`` when the source uses no pybind;
- the torch headers and the host-only functions are hidden from the device pass
  (``#ifndef __CUDA_ARCH__``), so ``cicc`` parses the kernels only. Template kernels,
  which the hidden host code would instantiate, are instantiated by a generated reference
  to each instance the host code names (``scalar_t`` of AT_DISPATCH_FLOATING_TYPES
  expanded); not done when an instance cannot be named so, or device code names torch.

Any step that does not apply falls back to the next layout, and a failed fast build is
retried as the plain ``load_inline`` layout, whose errors are the ones reported.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache, partial
from pathlib import Path
from typing import Any, Literal

from kz_stream.verify import lifeline
from kz_stream.verify._types import VERIFIER_VERSION
from kz_stream.verify.sandbox import kill_group

__all__ = [
    "BuildResult",
    "Builder",
    "InlineCall",
    "Toolchain",
    "extract_inline_calls",
    "kernel_names",
]

Layout = Literal["fast", "single", "load_inline"]

_STUB_HEADER = "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"
_LOG_TAIL = 6000


# ---- extracting the load_inline calls --------------------------------------------------


@dataclass(frozen=True)
class InlineCall:
    """The arguments of one ``load_inline`` call, with sources as lists of strings."""

    name: str
    cpp_sources: tuple[str, ...] = ()
    cuda_sources: tuple[str, ...] = ()
    functions: tuple[str, ...] = ()
    extra_cflags: tuple[str, ...] = ()
    extra_cuda_cflags: tuple[str, ...] = ()
    extra_ldflags: tuple[str, ...] = ()
    extra_include_paths: tuple[str, ...] = ()

    @staticmethod
    def from_kwargs(kwargs: dict[str, Any]) -> InlineCall:
        def seq(v: Any) -> tuple[str, ...]:
            if v is None:
                return ()
            if isinstance(v, str):
                return (v,)
            if isinstance(v, dict):
                return tuple(str(k) for k in v)
            return tuple(str(x) for x in v)

        return InlineCall(
            name=str(kwargs.get("name", "ext")),
            cpp_sources=seq(kwargs.get("cpp_sources")),
            cuda_sources=seq(kwargs.get("cuda_sources")),
            functions=seq(kwargs.get("functions")),
            extra_cflags=seq(kwargs.get("extra_cflags")),
            extra_cuda_cflags=seq(kwargs.get("extra_cuda_cflags")),
            extra_ldflags=seq(kwargs.get("extra_ldflags")),
            extra_include_paths=seq(kwargs.get("extra_include_paths")),
        )

    @property
    def module_name(self) -> str:
        """The extension's module (and ``.so``) name in the ``load_inline`` layout."""
        return re.sub(r"\W", "_", self.name) or "ext"

    @property
    def key(self) -> str:
        h = hashlib.sha256()
        # The name too: the load_inline layout compiles it in and names the module by it.
        for part in (self.name, self.cpp_sources, self.cuda_sources, self.functions,
                     self.extra_cflags,
                     self.extra_cuda_cflags, self.extra_ldflags, self.extra_include_paths):
            h.update(repr(part).encode())
        return h.hexdigest()


LOAD_INLINE_PARAMS = ("name", "cpp_sources", "cuda_sources", "functions", "extra_cflags",
                       "extra_cuda_cflags", "extra_ldflags", "extra_include_paths")


_UNKNOWN = object()


class _ConstEnv:
    """Module-level names bound to values computable from literals alone."""

    def __init__(self) -> None:
        self.env: dict[str, Any] = {}

    def value(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name) and self.env.get(node.id, _UNKNOWN) is not _UNKNOWN:
            return self.env[node.id]
        if isinstance(node, ast.List | ast.Tuple):
            return [self.value(e) for e in node.elts]
        if isinstance(node, ast.Dict):
            return {self.value(k): self.value(v) for k, v in zip(node.keys, node.values,
                                                                 strict=True) if k is not None}
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.value(node.left) + self.value(node.right)
        if isinstance(node, ast.JoinedStr):
            parts = []
            for v in node.values:
                if isinstance(v, ast.Constant):
                    parts.append(str(v.value))
                elif isinstance(v, ast.FormattedValue) and v.format_spec is None:
                    parts.append(str(self.value(v.value)))
                else:
                    raise ValueError("dynamic f-string")
            return "".join(parts)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "join" and len(node.args) == 1 and not node.keywords):
            return str(self.value(node.func.value)).join(self.value(node.args[0]))
        raise ValueError(f"not a constant: {ast.dump(node)[:80]}")

    def bind(self, stmt: ast.stmt) -> None:
        """Applies one top-level statement: a plain assignment of a computable value binds
        its names; any other binding of a name (``+=``, a loop, an import, a non-constant
        value) makes it unknown, so an argument using it sends the caller to recording."""
        if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets):
            try:
                v = self.value(stmt.value)
            except (ValueError, TypeError, KeyError):
                v = _UNKNOWN
            for t in stmt.targets:
                assert isinstance(t, ast.Name)
                self.env[t.id] = v
            return
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            # Its body's names are its own, except those it declares global.
            self.env[stmt.name] = _UNKNOWN
            for node in ast.walk(stmt):
                if isinstance(node, ast.Global):
                    self.env.update(dict.fromkeys(node.names, _UNKNOWN))
            return
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
                self.env[node.id] = _UNKNOWN
            elif isinstance(node, ast.alias):
                self.env[(node.asname or node.name).split(".")[0]] = _UNKNOWN


def _is_load_inline(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id == "load_inline"
    return isinstance(func, ast.Attribute) and func.attr == "load_inline"


def extract_inline_calls(source: str) -> list[InlineCall] | None:
    """The ``load_inline`` calls of a candidate, read without running it; None when an
    argument is not computable from literals (the caller then records them by running the
    module in the sandbox)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    consts = _ConstEnv()
    for stmt in tree.body:  # top-level bindings (a function's locals are not visible)
        consts.bind(stmt)
    calls: list[InlineCall] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and _is_load_inline(node.func)):
            continue
        kwargs: dict[str, Any] = {}
        try:
            for param, arg in zip(LOAD_INLINE_PARAMS, node.args, strict=False):
                kwargs[param] = consts.value(arg)
            for kw in node.keywords:
                if kw.arg is None:
                    return None
                if kw.arg in LOAD_INLINE_PARAMS:
                    kwargs[kw.arg] = consts.value(kw.value)
        except (ValueError, TypeError, KeyError):
            return None
        calls.append(InlineCall.from_kwargs(kwargs))
    return calls


def record_inline_calls(source: str) -> list[dict[str, Any]]:
    """Sandbox side: runs the candidate's top level with a recording ``load_inline``."""
    import types

    import torch.utils.cpp_extension as cpp_ext

    recorded: list[dict[str, Any]] = []

    def fake(*args: Any, **kwargs: Any) -> Any:
        kw = dict(zip(LOAD_INLINE_PARAMS, args, strict=False))
        kw.update({k: v for k, v in kwargs.items() if k in LOAD_INLINE_PARAMS})
        recorded.append(kw)

        def missing(*_: Any, **__: Any) -> Any:
            raise RuntimeError("recording stub")

        return types.SimpleNamespace(**{f: missing for f in InlineCall.from_kwargs(kw)
                                        .functions})

    cpp_ext.load_inline = fake
    from kz_stream.verify.loader import load_source

    try:
        load_source(source, "kz_candidate_record", os.getcwd())
    except Exception:
        if not recorded:
            raise
    return recorded


# ---- source analysis --------------------------------------------------------------------

_GLOBAL_RE = re.compile(r"__global__\s+(?:[\w:<>,\s\*&]+?\s+)?(\w+)\s*\(")
_TEMPLATE_KERNEL_RE = re.compile(r"template\s*<[^;{]*?>\s*(?:static\s+)?__global__")


def kernel_names(sources: Sequence[str]) -> list[str]:
    """Names of the ``__global__`` functions defined in CUDA sources."""
    names: list[str] = []
    for src in sources:
        for m in _GLOBAL_RE.finditer(strip_cpp_comments(src)):
            if m.group(1) not in names:
                names.append(m.group(1))
    return names


def strip_cpp_comments(src: str) -> str:
    """C/C++ source without its comments."""
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


def _top_level_items(src: str) -> list[str] | None:
    """Splits C++ source into top-level items (preprocessor lines, declarations ending in
    ``;`` or a closing brace). None when the braces do not balance."""
    items: list[str] = []
    i, n, start, depth = 0, len(src), 0, 0
    while i < n:
        c = src[i]
        if c == "#" and depth == 0 and src[start:i].strip() == "":
            j = i
            while True:
                j = src.find("\n", j)
                if j == -1:
                    j = n
                    break
                if src[j - 1] != "\\":
                    break
                j += 1
            items.append(src[i:j])
            i = start = j
            continue
        if c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            i = j + 1
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth < 0:
                return None
            if depth == 0:
                k = i + 1
                while k < n and src[k] in " \t":
                    k += 1
                if k < n and src[k] == ";":
                    i = k
                items.append(src[start : i + 1])
                start = i + 1
        elif c == ";" and depth == 0:
            items.append(src[start : i + 1])
            start = i + 1
        i += 1
    if depth != 0:
        return None
    if src[start:].strip():
        items.append(src[start:])
    return items


_TORCH_INCLUDE = re.compile(r"#\s*include\s*[<\"](torch|ATen|c10|pybind11)/")
_DEVICE_TORCH = re.compile(r"\b(torch|at|c10|TORCH_\w+|AT_\w+)\b")


# Template arguments that mean the same in the device pass, where torch is hidden.
_PLAIN_TARG = re.compile(
    r"^(?:(?:unsigned\s+|signed\s+)?(?:char|short|int|long(?:\s+long)?)|unsigned|float|double|"
    r"bool|u?int(?:8|16|32|64)_t|size_t|__half|__nv_bfloat16|half|"
    r"-?(?:0x[0-9a-fA-F]+|\d+)[uUlL]*|true|false)$")
# The types each AT_DISPATCH macro gives ``scalar_t``; other dispatch macros are not
# instantiated by hand (their types need the torch headers hidden from the device pass).
_DISPATCH_TYPES = {"AT_DISPATCH_FLOATING_TYPES": ("float", "double")}


def _template_instances(kernels: Sequence[str], host: str, constants: set[str]
                        ) -> list[str] | None:
    """``NAME<ARGS>`` for every template kernel instance the host code uses, with
    ``scalar_t`` expanded for AT_DISPATCH_FLOATING_TYPES; None when one cannot be
    named without the host code (another dispatch macro, a local constant)."""
    dispatch = set(re.findall(r"\b(AT_DISPATCH_\w+)\s*\(", host))
    instances: list[str] = []
    for name in kernels:
        uses = re.findall(rf"\b{name}\s*<((?:[^<>;{{}}]|<[^<>;{{}}]*>)*)>", host)
        if not uses:
            return None  # launched in a way we do not see (a pointer, a macro)
        for targs in uses:
            args = _split_params(targs)  # splits at top-level commas as for parameters
            expansions = [args]
            if any(re.search(r"\bscalar_t\b", a) for a in args):
                if not dispatch or not dispatch <= _DISPATCH_TYPES.keys():
                    return None
                types = sorted({t for d in dispatch for t in _DISPATCH_TYPES[d]})
                expansions = [[re.sub(r"\bscalar_t\b", t, a) for a in args] for t in types]
            for concrete in expansions:
                if not all(_PLAIN_TARG.match(a) or a in constants for a in concrete):
                    return None
                inst = f"{name}<{', '.join(concrete)}>"
                if inst not in instances:
                    instances.append(inst)
    return instances


def _hide_host_code(src: str) -> str | None:
    """The source with torch includes and host-only functions wrapped in
    ``#ifndef __CUDA_ARCH__``; None when that is not known to be safe.

    Template kernels are instantiated by the host code that launches them, which the
    device pass no longer sees: each instance the host code names is referenced again from
    a small function both passes see (as ``<<<>>>`` would reference it)."""
    clean = strip_cpp_comments(src)
    items = _top_level_items(clean)
    if items is None:
        return None
    template_kernels = [m.group(1) for item in items
                        if _TEMPLATE_KERNEL_RE.match(item.strip())
                        for m in [_GLOBAL_RE.search(item)] if m]
    if _TEMPLATE_KERNEL_RE.search(clean) and not template_kernels:
        return None  # a template kernel inside a namespace or another block
    out: list[str] = []
    host: list[str] = []
    constants: set[str] = set()
    for item in items:
        text = item.strip()
        if not text:
            continue
        if text.startswith("#"):
            if _TORCH_INCLUDE.match(text):
                out.append(f"#ifndef __CUDA_ARCH__\n{text}\n#endif")
            else:
                out.append(text)
            continue
        if re.match(r"using\s+namespace\s+(torch|at|c10)\b", text):
            out.append(f"#ifndef __CUDA_ARCH__\n{text}\n#endif")
            continue
        head = text.split("{", 1)[0]
        is_function = "{" in text and "(" in head and not re.match(
            r"(struct|class|union|enum|namespace|extern|template|typedef|using)\b", text)
        device_side = "__global__" in head or "__device__" in head or "__constant__" in text
        if is_function and not device_side:
            out.append(f"#ifndef __CUDA_ARCH__\n{text}\n#endif")
            host.append(text)
            continue
        if device_side and _DEVICE_TORCH.search(text):
            return None
        if re.match(r"(namespace|extern)\b", text):
            return None  # mixed blocks: not split
        if not is_function and not device_side:
            constants.update(re.findall(r"\b(\w+)\s*=", text))
        out.append(text)
    if template_kernels:
        defines = set(re.findall(r"#\s*define\s+(\w+)", clean))
        instances = _template_instances(template_kernels, "\n".join(host),
                                        constants | defines)
        if instances is None:
            return None
        refs = "".join(f"  (void)&{inst};\n" for inst in instances)
        out.append(f"__attribute__((unused)) static void __kz_instantiate() {{\n{refs}}}")
    return "\n".join(out) + "\n"


# C++ parameter types a generated wrapper can pass to a TORCH_LIBRARY schema.
_TENSOR_T = re.compile(r"^(const\s+)?(torch|at)::Tensor\s*&?$")
_INT_T = re.compile(r"^(const\s+)?(unsigned\s+)?(int|long|long long|int64_t|int32_t|size_t|"
                    r"short|unsigned|uint32_t|uint64_t)\s*&?$")
_FLOAT_T = re.compile(r"^(const\s+)?(float|double)\s*&?$")
_BOOL_T = re.compile(r"^(const\s+)?bool\s*&?$")
_TENSOR_LIST_T = re.compile(r"^(const\s+)?std::vector<\s*(torch|at)::Tensor\s*>\s*&?$")
_INT_LIST_T = re.compile(r"^(const\s+)?std::vector<\s*(int|int64_t|long)\s*>\s*&?$")


def _split_params(text: str) -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip() and p.strip() != "void"]


def _wrapper(name: str, ret: str, params: str) -> str | None:
    """A TORCH_LIBRARY-compatible wrapper around ``name``; None for unsupported types."""
    ret = " ".join(ret.split())
    ret = re.sub(r"^(static|inline|extern)\s+", "", ret)
    if _TENSOR_T.match(ret) or ret in ("torch::Tensor", "at::Tensor"):
        ret_t = "at::Tensor"
    elif _TENSOR_LIST_T.match(ret):
        ret_t = "std::vector<at::Tensor>"
    elif ret.startswith("std::tuple<") and all(
            _TENSOR_T.match(p) for p in _split_params(ret[len("std::tuple<"):-1])):
        ret_t = "std::tuple<" + ", ".join(
            "at::Tensor" for _ in _split_params(ret[len("std::tuple<"):-1])) + ">"
    elif ret == "void":
        ret_t = "void"
    elif _FLOAT_T.match(ret):
        ret_t = "double"
    elif _INT_T.match(ret):
        ret_t = "int64_t"
    elif _BOOL_T.match(ret):
        ret_t = "bool"
    else:
        return None
    decls, args = [], []
    for i, p in enumerate(_split_params(params)):
        if "=" in p:
            return None  # default arguments have no schema equivalent here
        m = re.match(r"^(.*?)(\w+)\s*$", p)
        if not m or not m.group(1).strip():
            return None
        typ = " ".join(m.group(1).split())
        if _TENSOR_T.match(typ):
            decls.append(f"const at::Tensor& a{i}")
            args.append(f"a{i}")
        elif _TENSOR_LIST_T.match(typ):
            decls.append(f"std::vector<at::Tensor> a{i}")
            args.append(f"a{i}")
        elif _INT_LIST_T.match(typ):
            decls.append(f"std::vector<int64_t> a{i}")
            inner = re.sub(r"^(const\s+)?std::vector<\s*|\s*>\s*&?$", "", typ)
            args.append(f"std::vector<{inner}>(a{i}.begin(), a{i}.end())")
        elif _FLOAT_T.match(typ):
            decls.append(f"double a{i}")
            base = re.sub(r"^const\s+|\s*&$", "", typ)
            args.append(f"static_cast<{base}>(a{i})")
        elif _BOOL_T.match(typ):
            decls.append(f"bool a{i}")
            args.append(f"a{i}")
        elif _INT_T.match(typ):
            decls.append(f"int64_t a{i}")
            base = re.sub(r"^const\s+|\s*&$", "", typ)
            args.append(f"static_cast<{base}>(a{i})")
        else:
            return None
    call = f"{name}({', '.join(args)})"
    body = f"{call};" if ret_t == "void" else f"return {call};"
    return f"static {ret_t} __kz_wrap_{name}({', '.join(decls)}) {{ {body} }}"


def _signatures(call: InlineCall) -> dict[str, tuple[str, str]] | None:
    """(return type, parameter text) of each exported function, from its definition or
    declaration; None if one is not found or is overloaded."""
    text = strip_cpp_comments("\n".join(call.cuda_sources + call.cpp_sources))
    sigs: dict[str, tuple[str, str]] = {}
    for fn in call.functions:
        pat = re.compile(r"(^|[;}\n])\s*((?:[\w:]+(?:<[^;{()]*>)?[\s\*&]+)+?)"
                         + re.escape(fn) + r"\s*\(([^)]*)\)\s*[;{]", re.M)
        found = {(" ".join(m.group(2).split()), " ".join(m.group(3).split()))
                 for m in pat.finditer(text)}
        if len(found) != 1:
            return None
        sigs[fn] = found.pop()
    return sigs


# ---- toolchain ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Toolchain:
    """Compiler, headers and flags for building against the installed torch."""

    nvcc: str
    nvcc_version: str
    cxx: str
    torch_version: str
    include_dirs: tuple[str, ...]
    lib_dirs: tuple[str, ...]
    arch: str  # e.g. "90"
    std: str
    cxx11_abi: bool
    has_cuda_torch: bool

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(repr(self).encode()).hexdigest()[:16]

    @staticmethod
    @cache
    def detect(arch: str | None = None) -> Toolchain:
        """Finds nvcc and the torch headers; ``arch`` defaults to the visible GPU's, or 90."""
        import inspect

        import torch
        import torch.utils.cpp_extension as cpp_ext

        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        cuda_home = (os.environ.get("CUDA_HOME") or cpp_ext.CUDA_HOME
                     or ("/usr/local/cuda" if os.path.isdir("/usr/local/cuda/include") else None)
                     or str(Path(os.path.realpath(nvcc)).parent.parent))
        try:
            ver = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout.strip().splitlines()[-1]
        except (OSError, subprocess.SubprocessError, IndexError):
            ver = "unknown"
        has_cuda = bool(torch.version.cuda)
        incs = list(cpp_ext.include_paths("cuda" if has_cuda and cpp_ext.CUDA_HOME else "cpu"))
        cuda_inc = os.path.join(cuda_home, "include")
        if cuda_inc not in incs:
            incs.append(cuda_inc)
        py_inc = sysconfig.get_path("include", scheme="posix_prefix")
        if py_inc:
            incs.append(py_inc)
        libs = [os.path.join(os.path.dirname(torch.__file__), "lib")]
        for sub in ("lib64", "lib"):
            d = os.path.join(cuda_home, sub)
            if os.path.isdir(d):
                libs.append(d)
                break
        if arch is None:
            arch = "90"
            if torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability()
                arch = f"{major}{minor}"
        src = inspect.getsource(cpp_ext._write_ninja_file_to_build_library)
        std = "c++20" if "-std=c++20" in src else "c++17"
        return Toolchain(
            nvcc=nvcc, nvcc_version=ver, cxx=os.environ.get("CXX", "g++"),
            torch_version=torch.__version__, include_dirs=tuple(incs), lib_dirs=tuple(libs),
            arch=arch, std=std, cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
            has_cuda_torch=has_cuda,
        )


# ---- building ----------------------------------------------------------------------------


@dataclass
class BuildResult:
    """One ``load_inline`` call built (or compile-checked)."""

    ok: bool
    call: InlineCall
    layout: Layout | None = None
    path: str | None = None  # shared library (None when only compile-checked)
    namespace: str | None = None  # TORCH_LIBRARY namespace for the "fast"/"single" layouts
    functions: tuple[str, ...] = ()
    log: str = ""
    seconds: float = 0.0
    cache_hit: bool = False
    attempts: list[str] = field(default_factory=list)

    def manifest(self) -> dict[str, Any]:
        """What a worker needs to hand the candidate this build instead of compiling."""
        return {"key": self.call.key, "name": self.call.name, "layout": self.layout,
                "path": self.path, "namespace": self.namespace,
                "functions": list(self.functions), "mod_name": self.call.module_name}


@dataclass
class _SharedBuild:
    """A build in flight and how many callers wait for it."""

    task: asyncio.Task[BuildResult]
    waiters: int = 0


class Builder:
    """Builds ``load_inline`` calls with at most ``jobs`` compilers at once.

    ``link=False`` only compiles (the CPU-only compile check). The cache directory is
    content-addressed: the key hashes the translation unit, flags and toolchain.
    """

    def __init__(self, cache_dir: str | os.PathLike[str] | None = None, *, jobs: int | None = None,
                 toolchain: Toolchain | None = None, link: bool = True,
                 timeout_s: float = 600.0, fast: bool = True) -> None:
        self.cache_dir = Path(cache_dir or os.path.join(tempfile.gettempdir(), "kz-build-cache"))
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.toolchain = toolchain or Toolchain.detect()
        self.link = link
        self.timeout_s = timeout_s
        self.fast = fast
        self._sem = asyncio.Semaphore(jobs or os.cpu_count() or 1)
        self._inflight: dict[str, _SharedBuild] = {}
        stub = self.cache_dir / "stub" / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "cuda_cmake_macros.h").write_text(_STUB_HEADER)
        self._stub_dir = str(self.cache_dir / "stub")

    # -- flags

    def _common(self, name: str) -> list[str]:
        tc = self.toolchain
        flags = [f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
                 f"-D_GLIBCXX_USE_CXX11_ABI={int(tc.cxx11_abi)}"]
        if not tc.has_cuda_torch:
            flags += ["-I", self._stub_dir]  # the CPU wheel lacks this generated header
        for d in tc.include_dirs:
            flags += ["-isystem", d]
        return flags

    def _nvcc_flags(self, call: InlineCall, name: str) -> list[str]:
        tc = self.toolchain
        flags = self._common(name) + [f"-I{os.path.abspath(p)}" for p in call.extra_include_paths]
        flags += ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                  "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
                  "--expt-relaxed-constexpr",
                  f"-gencode=arch=compute_{tc.arch},code=sm_{tc.arch}",
                  "--compiler-options", "-fPIC"]
        if self.fast:
            # Host code only launches kernels: skip optimising the torch headers' inline
            # code (a user's own -O flag, later on the line, still wins).
            flags += ["-Xcompiler", "-O0"]
        flags += [f for f in call.extra_cuda_cflags if f.strip()]
        if not any(f.startswith("-std=") for f in flags):
            flags.append(f"-std={tc.std}")
        return flags

    def _cxx_flags(self, call: InlineCall, name: str) -> list[str]:
        flags = self._common(name) + [f"-I{os.path.abspath(p)}" for p in call.extra_include_paths]
        flags += ["-fPIC", f"-std={self.toolchain.std}", "-O2"]
        return flags + [f for f in call.extra_cflags if f.strip()]

    def _ld_flags(self, call: InlineCall, python: bool) -> list[str]:
        flags = ["-shared"]
        for d in self.toolchain.lib_dirs:
            flags += [f"-L{d}", f"-Wl,-rpath,{d}"]
        flags += ["-lc10", "-ltorch_cpu", "-ltorch"]
        if self.toolchain.has_cuda_torch:
            flags += ["-lc10_cuda", "-ltorch_cuda"]
        if python:
            flags.append("-ltorch_python")
        flags.append("-lcudart")
        return flags + [f for f in call.extra_ldflags if f.strip()]

    # -- translation units

    def _fast_unit(self, call: InlineCall, hide: bool) -> tuple[str, str, tuple[int, int]] | None:
        """(source, namespace, first and last line of the user's code) of the single-TU
        layout, or None if it does not apply."""
        user = "\n".join(call.cuda_sources)
        if not call.functions or re.search(r"\b(pybind11|PYBIND11_\w+|py::)", user):
            return None
        sigs = _signatures(call)
        if sigs is None:
            return None
        wrappers = []
        for fn, (ret, params) in sigs.items():
            w = _wrapper(fn, ret, params)
            if w is None:
                return None
            wrappers.append(w)
        user = re.sub(r"#\s*include\s*<torch/extension\.h>", "#include <torch/types.h>", user)
        # Declarations from cpp_sources may be needed if the cuda source lacks them.
        decls = "\n".join(s for s in call.cpp_sources
                          if not re.search(r"PYBIND11|py::", s))
        decls = re.sub(r"#\s*include\s*<torch/extension\.h>", "#include <torch/types.h>", decls)
        if hide:
            hidden = _hide_host_code(user)
            if hidden is None:
                return None
            user = hidden
        body_key = hashlib.sha256((user + decls + "".join(wrappers)).encode()).hexdigest()
        ns = f"kz_{body_key[:16]}"
        reg = "\n".join(f'  m.def("{fn}", &__kz_wrap_{fn});' for fn in sigs)
        guard_open, guard_close = ("#ifndef __CUDA_ARCH__\n", "#endif\n") if hide else ("", "")
        prologue = (f"{guard_open}#include <torch/types.h>\n{guard_close}"
                    "#include <cuda.h>\n#include <cuda_runtime.h>\n")
        first = prologue.count("\n") + 1
        span = (first, first + user.count("\n"))
        text = (
            f"{prologue}{user}\n{guard_open}{decls}\n#include <torch/library.h>\n"
            + "\n".join(wrappers)
            + f"\nTORCH_LIBRARY({ns}, m) {{\n{reg}\n}}\n{guard_close}"
        )
        return text, ns, span

    def _inline_units(self, call: InlineCall) -> tuple[str, str]:
        """The ``main.cpp`` and ``cuda.cu`` that ``load_inline`` itself would write."""
        cpp = ["#include <torch/extension.h>", *call.cpp_sources]
        if call.functions:
            cpp.append("PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {")
            cpp += [f'm.def("{f}", torch::wrap_pybind_function({f}), "{f}");'
                    for f in call.functions]
            cpp.append("}")
        cu = ["#include <torch/types.h>", "#include <cuda.h>", "#include <cuda_runtime.h>",
              *call.cuda_sources]
        return "\n".join(cpp), "\n".join(cu)

    # -- running the compilers

    async def _run(self, cmd: list[str], cwd: str) -> tuple[bool, str]:
        async with self._sem:
            # The wrapper kills the compiler's group (nvcc's cicc and ptxas, ninja's jobs)
            # when ``keep``, held by this process alone, closes: at the latest when it exits.
            watch, keep = os.pipe()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *lifeline.wrap(cmd, watch), cwd=cwd, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                    pass_fds=(watch,))
            except BaseException:
                os.close(keep)
                raise
            finally:
                os.close(watch)
            lifeline.track(proc.pid)
            try:
                out, _ = await asyncio.wait_for(proc.communicate(), self.timeout_s)
            except TimeoutError:
                kill_group(proc.pid)
                await proc.wait()
                return False, f"compiler timed out after {self.timeout_s:g} s: {shlex.join(cmd)}"
            except asyncio.CancelledError:
                kill_group(proc.pid)  # no one waits for this build: leave no compiler behind
                await proc.wait()
                raise
            finally:
                os.close(keep)
                lifeline.untrack(proc.pid)
        text = out.decode(errors="replace")
        return proc.returncode == 0, text

    async def build(self, call: InlineCall) -> BuildResult:
        """Builds (or compile-checks) one call; identical calls in flight share one build."""
        key = hashlib.sha256(
            f"{call.key}{self.toolchain.fingerprint}{self.link}{self.fast}{VERIFIER_VERSION}"
            .encode()).hexdigest()
        shared = self._inflight.get(key)
        if shared is None:
            # A task of its own, not the first caller's: one caller cancelled (its consumer
            # shutting down) must not cancel the build the others wait for.
            shared = self._inflight[key] = _SharedBuild(
                asyncio.ensure_future(self._build(call, key)))
            shared.task.add_done_callback(partial(self._build_done, key))
        shared.waiters += 1
        try:
            return await asyncio.shield(shared.task)
        finally:
            shared.waiters -= 1
            if not shared.waiters:
                shared.task.cancel()  # no one waits for it any more (no-op once done)

    def _build_done(self, key: str, task: asyncio.Task[BuildResult]) -> None:
        self._inflight.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved: a build's error reaches its callers, not the log

    async def _build(self, call: InlineCall, key: str) -> BuildResult:
        started = time.monotonic()
        entry = self.cache_dir / key
        done = entry / "result.txt"
        if done.exists():
            c_layout, c_ns, c_path = [*done.read_text().split("\n"), "", "", ""][:3]
            return BuildResult(True, call, c_layout, c_path or None,  # type: ignore[arg-type]
                               c_ns or None, call.functions, "", time.monotonic() - started, True)
        work = Path(tempfile.mkdtemp(prefix="kzb-", dir=self.cache_dir))
        attempts: list[str] = []
        log = ""
        try:
            plans: list[tuple[Layout, bool]] = []
            if self.fast:
                plans += [("fast", True), ("single", False)]
            plans.append(("load_inline", False))
            for layout, hide in plans:
                if layout == "load_inline":
                    ok, log, path, ns = await self._build_inline(call, work)
                else:
                    unit = self._fast_unit(call, hide)
                    if unit is None:
                        continue
                    text, ns_name, span = unit
                    ok, log, path, ns = await self._build_single(call, work, text, ns_name)
                attempts.append(f"{layout}:{'ok' if ok else 'failed'}")
                if ok:
                    entry.mkdir(exist_ok=True)
                    final = None
                    if path is not None:
                        final = str(entry / os.path.basename(path))
                        shutil.move(path, final)
                    tmp = done.with_suffix(f".tmp-{os.getpid()}")
                    tmp.write_text(f"{layout}\n{ns or ''}\n{final or ''}")
                    os.replace(tmp, done)  # another builder sharing the cache reads it whole
                    return BuildResult(True, call, layout, final, ns, call.functions, log,
                                       time.monotonic() - started, False, attempts)
                if layout == "single" and _errors_within(log, span):
                    break  # the user's own code fails to compile: skip the slow retry
            return BuildResult(False, call, None, None, None, call.functions,
                               log[-_LOG_TAIL:], time.monotonic() - started, False, attempts)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    async def _build_single(self, call: InlineCall, work: Path, text: str, ns: str
                            ) -> tuple[bool, str, str | None, str | None]:
        cu = work / f"{ns}.cu"
        cu.write_text(text)
        obj = work / f"{ns}.o"
        ok, log = await self._run([self.toolchain.nvcc, *self._nvcc_flags(call, ns), "-c",
                                   str(cu), "-o", str(obj)], str(work))
        if not ok or not self.link:
            return ok, log, None, ns
        so = work / f"{ns}.so"
        ok, log2 = await self._run([self.toolchain.cxx, str(obj), *self._ld_flags(call, False),
                                    "-o", str(so)], str(work))
        return ok, log + log2, str(so), ns

    async def _build_inline(self, call: InlineCall, work: Path
                            ) -> tuple[bool, str, str | None, str | None]:
        name = call.module_name
        main_src, cu_src = self._inline_units(call)
        (work / "main.cpp").write_text(main_src)
        jobs = [self._run([self.toolchain.cxx, *self._cxx_flags(call, name), "-c", "main.cpp",
                           "-o", "main.o"], str(work))]
        objs = ["main.o"]
        if call.cuda_sources:
            (work / "cuda.cu").write_text(cu_src)
            jobs.append(self._run([self.toolchain.nvcc, *self._nvcc_flags(call, name), "-c",
                                   "cuda.cu", "-o", "cuda.cuda.o"], str(work)))
            objs.append("cuda.cuda.o")
        results = await asyncio.gather(*jobs)
        log = "".join(r[1] for r in results)
        if not all(r[0] for r in results) or not self.link:
            return all(r[0] for r in results), log, None, None
        so = work / f"{name}.so"
        ok, log2 = await self._run([self.toolchain.cxx, *objs, *self._ld_flags(call, True),
                                    "-o", str(so)], str(work))
        return ok, log + log2, str(so), None


_ERROR_LINE = re.compile(r"\((\d+)\): (?:catastrophic )?error")


def _errors_within(log: str, span: tuple[int, int]) -> bool:
    """Whether every compiler error in ``log`` points at a line of the user's code."""
    lines = [int(m.group(1)) for m in _ERROR_LINE.finditer(log)]
    return bool(lines) and all(span[0] <= n <= span[1] for n in lines)


def baseline_load_inline_build(call: InlineCall, build_dir: str) -> float:
    """Builds ``call`` with torch's own ``load_inline`` (the benchmark baseline); returns
    seconds. Runs in the calling process."""
    import torch.utils.cpp_extension as cpp_ext

    started = time.monotonic()
    cpp_ext.load_inline(  # type: ignore[no-untyped-call]
        name=call.name, cpp_sources=list(call.cpp_sources), cuda_sources=list(call.cuda_sources),
        functions=list(call.functions) or None, extra_cflags=list(call.extra_cflags),
        extra_cuda_cflags=list(call.extra_cuda_cflags), extra_ldflags=list(call.extra_ldflags),
        build_directory=build_dir, verbose=False,
    )
    return time.monotonic() - started
