"""An LLM reply's code: written into the reply's form, pulled out of a reply; and a
normalized hash of a module for dedup."""

from __future__ import annotations

import ast
import hashlib
import re

__all__ = ["extract_code", "fence_code", "normalized_hash"]

# An opening fence with an optional language tag, then the body up to a closing fence or
# the end of the text (replies cut by max_tokens often lack the closing fence).
_FENCE = re.compile(
    r"^[ \t]*(?P<fence>```+|~~~+)[ \t]*(?P<lang>[\w+.-]*)[^\n]*\n"
    r"(?P<body>.*?)(?:^[ \t]*(?P=fence)[ \t]*$|\Z)",
    re.DOTALL | re.MULTILINE,
)
_CODE_LANGS = {"", "python", "py", "python3", "py3"}
_CODE_START = re.compile(r"^(import |from |class |def |@|#|[A-Za-z_]\w* *=)")
_THINK = re.compile(r"<think>.*?(</think>|\Z)", re.DOTALL)


def fence_code(code: str) -> str:
    """``code`` as an answer is written (a ```python fence), what ``extract_code`` reads."""
    return f"```python\n{code.rstrip()}\n```"


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def _trim_to_parse(code: str, max_trim: int = 40) -> str:
    """Drops trailing lines (prose, a truncated statement) until the code parses."""
    if _parses(code):
        return code
    lines = code.rstrip().splitlines()
    for cut in range(1, min(max_trim, len(lines) - 1) + 1):
        candidate = "\n".join(lines[:-cut])
        if _parses(candidate):
            return candidate
    return code


def _unfenced(text: str) -> str:
    """Code in a reply without fences: from the first code-looking line on."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if _CODE_START.match(line):
            return "\n".join(lines[i:])
    return text


def extract_code(text: str, *, require: str | None = None) -> str | None:
    """Returns the Python code of a reply, or None when there is none.

    Fenced blocks tagged as Python (or untagged) are the candidates; without fences the
    reply from its first code-looking line. Among candidates, those that contain
    ``require`` (e.g. ``"class ModelNew"``) win, then those that parse, then the longest.
    Trailing junk lines are trimmed while that makes the code parse. Code that still does
    not parse is returned as is: the caller reports the syntax error.
    """
    text = _THINK.sub("", text.replace("\r\n", "\n"))
    blocks = [
        m.group("body") for m in _FENCE.finditer(text) if m.group("lang").lower() in _CODE_LANGS
    ]
    if not blocks:
        blocks = [_unfenced(text)]
    candidates = [_trim_to_parse(b.strip("\n")) for b in blocks if b.strip()]
    if not candidates:
        return None

    def rank(code: str) -> tuple[bool, bool, int]:
        return (require is None or require in code, _parses(code), len(code))

    best = max(candidates, key=rank)
    if require is not None and require not in best:
        return None
    return best.rstrip() + "\n"


class _Normalizer(ast.NodeTransformer):
    """Drops docstrings and renames function-local names (arguments, locals) to positional
    placeholders, so formatting, comments and local naming do not change the hash. Module
    level names, attributes and class names stay: they are the module's interface."""

    def __init__(self) -> None:
        self._scopes: list[dict[str, str]] = []

    def _strip_doc(self, body: list[ast.stmt]) -> list[ast.stmt]:
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            return body[1:] or [ast.Pass()]
        return body

    def visit_Module(self, node: ast.Module) -> ast.AST:
        node.body = self._strip_doc(node.body)
        self.generic_visit(node)
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        node.body = self._strip_doc(node.body)
        self.generic_visit(node)
        return node

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> ast.AST:
        node.body = self._strip_doc(node.body)
        mapping: dict[str, str] = {}
        a = node.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is not None and arg.arg != "self":
                mapping[arg.arg] = f"_v{len(mapping)}"
                arg.arg = mapping[arg.arg]
            if arg is not None:
                arg.annotation = None  # annotations do not change what runs
        node.returns = None
        declared: set[str] = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Global | ast.Nonlocal):
                declared.update(sub.names)
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Name)
                and isinstance(sub.ctx, ast.Store)
                and sub.id not in mapping
                and sub.id not in declared
            ):
                mapping[sub.id] = f"_v{len(mapping)}"
        self._scopes.append(mapping)
        self.generic_visit(node)
        self._scopes.pop()
        return node

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        return self._visit_function(node)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> ast.AST:
        return self._visit_function(node)

    def visit_Name(self, node: ast.Name) -> ast.AST:
        for scope in reversed(self._scopes):
            if node.id in scope:
                node.id = scope[node.id]
                break
        return node


def normalized_hash(source: str) -> str:
    """A sha256 of the module's normalized AST (see ``_Normalizer``); sources that do not
    parse hash their whitespace-collapsed text."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return hashlib.sha256(" ".join(source.split()).encode()).hexdigest()
    tree = _Normalizer().visit(tree)
    return hashlib.sha256(ast.dump(tree, annotate_fields=False).encode()).hexdigest()
