"""C++ source analysis and rewriting for the fast build layout: kernel names, top-level
items, the host code hidden from the device pass, template instances named for it, and
``TORCH_LIBRARY`` wrappers for the exported functions."""

from __future__ import annotations

import re
from collections.abc import Sequence

from kz_stream.verify._extract import InlineCall

__all__ = ["hide_host_code", "kernel_names", "signatures", "strip_cpp_comments", "wrapper"]


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


def hide_host_code(src: str) -> str | None:
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
# Scalar parameters, tried in this order, and the operator-schema type each widens to (the
# wrapper narrows it back for the user's function).
_SCALARS = ((_FLOAT_T, "double"), (_BOOL_T, "bool"), (_INT_T, "int64_t"))


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


def wrapper(name: str, ret: str, params: str) -> str | None:
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
        elif wide := next((w for rx, w in _SCALARS if rx.match(typ)), None):
            decls.append(f"{wide} a{i}")
            base = re.sub(r"^const\s+|\s*&$", "", typ)
            args.append(f"a{i}" if wide == "bool" else f"static_cast<{base}>(a{i})")
        else:
            return None
    call = f"{name}({', '.join(args)})"
    body = f"{call};" if ret_t == "void" else f"return {call};"
    return f"static {ret_t} __kz_wrap_{name}({', '.join(decls)}) {{ {body} }}"


def signatures(call: InlineCall) -> dict[str, tuple[str, str]] | None:
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


