"""An API co-occurrence catalog mined from real model code that an installed package ships.

A *document* is one top-level ``nn.Module``-like class (a class with a ``forward``) or one
top-level function of a model file; its API set is the canonical compute APIs it calls
(``kz_stream.modules._apis``; neutral ops and plumbing left out). Counts are numbers of
distinct documents. transformers keeps many verbatim copies of one class under different
model names ("Copied from"), so documents are deduplicated by their AST with docstrings
removed and the model's name blanked out; otherwise copy-paste would dominate the counts.

Files are parsed, never imported. Rebuild the shipped catalog with::

    python -m kz_stream.modules build            # writes kz_stream/data/api_catalog.json
    python -m kz_stream.modules build --out X.json --package transformers
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

from kz_stream.modules._apis import _collect_aliases, find_api_calls

__all__ = [
    "CATALOG_FORMAT",
    "DEFAULT_SOURCES",
    "ApiCatalog",
    "default_catalog",
    "main",
    "mine_catalog",
    "mine_files",
    "package_files",
]

CATALOG_FORMAT = 1
# Model-definition files per package (globs relative to the package directory).
DEFAULT_SOURCES: dict[str, str] = {
    "transformers": "models/*/modeling_*.py",
    "torchvision": "models/**/*.py",
    "timm": "models/**/*.py",
}
_DATA_FILE = "api_catalog.json"


@dataclass(frozen=True)
class ApiCatalog:
    """Counts of single APIs, pairs and triples (keys are sorted tuples)."""

    apis: dict[str, int]
    pairs: dict[tuple[str, str], int]
    triples: dict[tuple[str, str, str], int]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Returns the JSON form (lists sorted by count, then name, for stable diffs)."""

        def rows(d: dict[Any, int]) -> list[list[Any]]:
            return [[*k, c] for k, c in sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))]

        return {
            "format": CATALOG_FORMAT,
            "meta": self.meta,
            "apis": dict(sorted(self.apis.items(), key=lambda kv: (-kv[1], kv[0]))),
            "pairs": rows(self.pairs),
            "triples": rows(self.triples),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ApiCatalog:
        if data.get("format") != CATALOG_FORMAT:
            raise ValueError(f"unsupported catalog format {data.get('format')!r}")
        return cls(
            apis={str(k): int(v) for k, v in data["apis"].items()},
            pairs={(str(r[0]), str(r[1])): int(r[2]) for r in data["pairs"]},
            triples={(str(r[0]), str(r[1]), str(r[2])): int(r[3]) for r in data["triples"]},
            meta=dict(data.get("meta", {})),
        )

    def save(self, path: str | Path) -> Path:
        """Writes the JSON form with one API, pair or triple per line (readable diffs)."""
        data = self.to_json()

        def block(items: list[str], open_: str, close: str) -> str:
            return open_ + "\n" + ",\n".join(items) + "\n" + close

        dumps = functools.partial(json.dumps, ensure_ascii=False)
        parts = [
            f'"format": {CATALOG_FORMAT}',
            f'"meta": {dumps(data["meta"], sort_keys=True)}',
            '"apis": ' + block([f"{dumps(k)}: {v}" for k, v in data["apis"].items()], "{", "}"),
            '"pairs": ' + block([dumps(r) for r in data["pairs"]], "[", "]"),
            '"triples": ' + block([dumps(r) for r in data["triples"]], "[", "]"),
        ]
        out = Path(path)
        out.write_text("{\n" + ",\n".join(parts) + "\n}\n")
        return out

    @classmethod
    def load(cls, path: str | Path) -> ApiCatalog:
        return cls.from_json(json.loads(Path(path).read_text()))


@functools.cache
def default_catalog() -> ApiCatalog:
    """The catalog shipped as package data (``kz_stream/data/api_catalog.json``)."""
    return ApiCatalog.from_json(
        json.loads(files("kz_stream.data").joinpath(_DATA_FILE).read_text())
    )


def package_files(package: str, pattern: str) -> list[Path]:
    """The files matching ``pattern`` inside an installed package (found, not imported)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {package!r} is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    return sorted(root.glob(pattern))


def _strip_docstrings(node: ast.AST) -> None:
    for n in ast.walk(node):
        if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef | ast.Module):
            body = n.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                n.body = body[1:] or [ast.Pass()]


def _documents(tree: ast.Module) -> Iterator[ast.ClassDef | ast.FunctionDef]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any(
            isinstance(b, ast.FunctionDef) and b.name == "forward" for b in node.body
        ):
            yield node
        elif isinstance(node, ast.FunctionDef):
            yield node


def _model_token_re(path: Path) -> re.Pattern[str] | None:
    # transformers/models/<name>/modeling_<name>.py -> blank "<name>" (and without "_").
    name = path.stem.removeprefix("modeling_")
    if len(name) < 3:
        return None
    tokens = {re.escape(name), re.escape(name.replace("_", ""))}
    return re.compile("|".join(sorted(tokens, key=len, reverse=True)), re.IGNORECASE)


def iter_document_api_sets(paths: Iterable[Path]) -> Iterator[tuple[str, frozenset[str]]]:
    """Yields (dedup key, API set) for every document in the given files."""
    for path in paths:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        aliases = _collect_aliases(tree)
        token = _model_token_re(path)
        for doc in _documents(tree):
            apis = frozenset(find_api_calls(tree, nodes=[doc], aliases=aliases).apis)
            if not apis:
                continue
            _strip_docstrings(doc)
            dump = ast.dump(doc, annotate_fields=False)
            if token is not None:
                dump = token.sub("X", dump)
            yield hashlib.blake2b(dump.encode(), digest_size=16).hexdigest(), apis


def mine_files(
    paths: Iterable[Path],
    *,
    min_pair_count: int = 2,
    min_triple_count: int = 3,
    max_apis_per_document: int = 16,
    meta: dict[str, Any] | None = None,
) -> ApiCatalog:
    """Mines API, pair and triple counts from the given Python files.

    Documents calling more than ``max_apis_per_document`` APIs (whole-model orchestrators,
    not kernel-sized modules) count for single APIs only. Pairs and triples seen fewer
    than ``min_pair_count`` / ``min_triple_count`` times are dropped.
    """
    paths = list(paths)
    apis: Counter[str] = Counter()
    pairs: Counter[tuple[str, str]] = Counter()
    triples: Counter[tuple[str, str, str]] = Counter()
    seen: set[str] = set()
    n_docs = 0
    for key, api_set in iter_document_api_sets(paths):
        n_docs += 1
        if key in seen:
            continue
        seen.add(key)
        ordered = sorted(api_set)
        apis.update(ordered)
        if len(ordered) > max_apis_per_document:
            continue
        pairs.update(itertools.combinations(ordered, 2))
        triples.update(itertools.combinations(ordered, 3))
    info = {
        **(meta or {}),
        "files": len(paths),
        "documents": n_docs,
        "distinct_documents": len(seen),
        "min_pair_count": min_pair_count,
        "min_triple_count": min_triple_count,
        "max_apis_per_document": max_apis_per_document,
    }
    return ApiCatalog(
        apis=dict(apis),
        pairs={k: c for k, c in pairs.items() if c >= min_pair_count},
        triples={k: c for k, c in triples.items() if c >= min_triple_count},
        meta=info,
    )


def mine_catalog(
    packages: Sequence[str] = ("transformers",),
    *,
    sources: dict[str, str] | None = None,
    **options: Any,
) -> ApiCatalog:
    """Mines the model files of installed packages (``DEFAULT_SOURCES`` says which files;
    ``sources`` overrides the glob per package); ``options`` go to ``mine_files``."""
    globs = {**DEFAULT_SOURCES, **(sources or {})}
    paths: list[Path] = []
    versions = {}
    for package in packages:
        paths += package_files(package, globs[package])
        versions[package] = importlib.metadata.version(package)
    return mine_files(paths, meta={"packages": versions}, **options)


def default_catalog_path() -> Path:
    """Where ``build`` writes by default: the package-data file in this source tree."""
    return Path(__file__).resolve().parent.parent / "data" / _DATA_FILE


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kz_stream.modules build [--out PATH] [--package NAME ...]``."""
    parser = argparse.ArgumentParser(prog="python -m kz_stream.modules")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="mine the catalog from installed model code")
    build.add_argument("--out", type=Path, default=None)
    build.add_argument("--package", action="append", default=None)
    build.add_argument("--min-pair-count", type=int, default=2)
    build.add_argument("--min-triple-count", type=int, default=3)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    catalog = mine_catalog(
        args.package or ["transformers"],
        min_pair_count=args.min_pair_count,
        min_triple_count=args.min_triple_count,
    )
    seconds = time.perf_counter() - t0
    out = catalog.save(args.out or default_catalog_path())
    m = catalog.meta
    print(
        f"{out}: {len(catalog.apis)} APIs, {len(catalog.pairs)} pairs, "
        f"{len(catalog.triples)} triples from {m['distinct_documents']} distinct of "
        f"{m['documents']} documents in {m['files']} files ({seconds:.1f} s)"
    )
    return 0

