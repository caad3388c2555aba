"""The ``load_inline`` calls of a CUDA candidate: read from its source when every argument
is a literal (or a module-level name bound to one), else recorded by running its top level
in the sandbox with a recording ``load_inline``."""

from __future__ import annotations

import ast
import hashlib
import os
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["LOAD_INLINE_PARAMS", "InlineCall", "extract_inline_calls", "record_inline_calls"]

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
    from kz_stream.verify._loader import load_source

    try:
        load_source(source, "kz_candidate_record", os.getcwd())
    except Exception:
        if not recorded:
            raise
    return recorded
