"""A module synthesizer: KernelBench-format modules composed from the API catalog.

API sets are drawn from the mined co-occurrence catalog (pairs and triples, plus single
APIs) restricted to the operations in ``kz_stream.warmstart.ops``, with the Proposer's
own sampler, so the frontier tilt is the same. Each set becomes one module: the ops in the
order their kinds allow (matmul, elementwise, whole-row, reduction), with shapes drawn per
module. The module's forward is one ``x = <call>`` line per op, which is what lets the
Triton teacher lower it back (``kz_stream.warmstart.teacher``).

Held-out modules are set aside by the hash of their source, so a measurement never sees a
module that SFT was trained on.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from kz_stream.modules import ApiCatalog, ApiSetSampler, Frontier, default_catalog
from kz_stream.warmstart.ops import Op, ops_by_api

__all__ = [
    "ModuleKind",
    "SynthModule",
    "Synthesizer",
    "feasible",
    "is_held_out",
    "module_kind",
    "synth_catalog",
    "synthesize",
]

ModuleKind = Literal["single", "fused", "norm", "reduction", "matmul"]
_ORDER = {"matmul": 0, "unary": 1, "binary": 1, "rowmap": 2, "reduce": 3}


@dataclass(frozen=True)
class SynthModule:
    """One synthesized module: its API set, kind and KernelBench-format source."""

    api_set: tuple[str, ...]
    kind: ModuleKind
    source: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()


def feasible(apis: Sequence[str]) -> bool:
    """Whether one module can call exactly these APIs (all known, one matmul, one reduction)."""
    table = ops_by_api()
    if not apis or any(a not in table for a in apis):
        return False
    kinds = [table[a].kind for a in apis]
    return kinds.count("matmul") <= 1 and kinds.count("reduce") <= 1


def synth_catalog(catalog: ApiCatalog | None = None) -> ApiCatalog:
    """The catalog restricted to the API sets the synthesizer can build."""
    catalog = catalog or default_catalog()
    return ApiCatalog(
        apis={a: c for a, c in catalog.apis.items() if feasible([a])},
        pairs={k: c for k, c in catalog.pairs.items() if feasible(k)},
        triples={k: c for k, c in catalog.triples.items() if feasible(k)},
        meta={**catalog.meta, "restricted_to": "kz_stream.warmstart.ops"},
    )


def module_kind(ops: Sequence[Op]) -> ModuleKind:
    kinds = {op.kind for op in ops}
    if "matmul" in kinds:
        return "matmul"
    if "reduce" in kinds:
        return "reduction"
    if "rowmap" in kinds:
        return "norm"
    return "single" if len(ops) == 1 else "fused"


def is_held_out(module: SynthModule, fraction: float) -> bool:
    """Whether a module belongs to the held-out share (a fixed function of its source)."""
    return int(module.digest[:8], 16) / 0xFFFFFFFF < fraction


def _ordered(apis: Sequence[str], rng: random.Random) -> list[Op]:
    table = ops_by_api()
    ops = [table[a] for a in apis]
    rng.shuffle(ops)
    ops.sort(key=lambda op: _ORDER[op.kind])  # stable: elementwise stay shuffled
    # An elementwise op may also follow the whole-row part (unary ones after a reduction).
    tail = [op for op in ops if op.kind == "unary"]
    if tail and any(op.kind in ("rowmap", "reduce") for op in ops) and rng.random() < 0.3:
        moved = tail[-1]
        ops.remove(moved)
        ops.append(moved)
    return ops


_ROWS = (16, 32, 64, 128, 256)
_COLS = (64, 128, 256, 384, 512, 768, 1000, 1024, 2048)
_SEQ = (4, 8, 16)
_MM = (32, 64, 128, 256)
_K = (32, 64, 128, 256, 512)


def synthesize(apis: Sequence[str], rng: random.Random) -> SynthModule:
    """Writes one module that calls exactly ``apis`` (which must be ``feasible``)."""
    if not feasible(apis):
        raise ValueError(f"no module calls exactly {sorted(apis)}")
    ops = _ordered(apis, rng)
    has_mm = ops[0].kind == "matmul"
    consts: list[tuple[str, int]] = []
    if has_mm:
        consts = [("batch_size", rng.choice(_MM)), ("in_features", rng.choice(_K)),
                  ("out_features", rng.choice((*_MM, 512)))]
        x_shape = "batch_size, in_features"
        y_shape = "batch_size, out_features"
        n_name = "out_features"
    else:
        consts = [("batch_size", rng.choice(_ROWS))]
        if rng.random() < 0.25:
            consts.append(("seq_len", rng.choice(_SEQ)))
        consts.append(("features", rng.choice(_COLS)))
        x_shape = y_shape = ", ".join(name for name, _ in consts)
        n_name = "features"

    init_lines: list[str] = []
    body: list[str] = []
    inputs = ["x"]
    input_shapes = [x_shape]
    uses_n = False
    for op in ops:
        attr = ""
        if op.module is not None:
            attr = _attr_name(op, init_lines)
            ctor = op.module.format(n=n_name, k="in_features")
            uses_n = uses_n or "{n}" in op.module or "{k}" in op.module
            init_lines.append(f"        self.{attr} = {ctor}")
        y = ""
        if op.api in ("torch.matmul", "torch.mm"):
            y = "w"
            inputs.append("w")
            input_shapes.append("in_features, out_features")
        elif op.kind == "binary":
            y = f"y{sum(1 for i in inputs if i.startswith('y')) or ''}"
            inputs.append(y)
            input_shapes.append(y_shape)
        body.append(f"        x = {op.torch.format(x='x', y=y, m=attr)}")

    init_params = ["in_features", "out_features"] if has_mm and uses_n else (
        ["features"] if uses_n else [])
    sig = ", ".join(f"{p}: int" for p in init_params)
    lines = ["import torch", "import torch.nn as nn", ""]
    lines += [f"{name} = {value}" for name, value in consts]
    lines += ["", "", "class Model(nn.Module):",
              f'    """{_describe(ops)}"""', "",
              f"    def __init__(self{', ' + sig if sig else ''}):",
              "        super().__init__()", *init_lines, "",
              "    def forward(self, "
              + ", ".join(f"{i}: torch.Tensor" for i in inputs) + ") -> torch.Tensor:",
              *body, "        return x", "", "",
              "def get_inputs():",
              "    return [" + ", ".join(f"torch.randn({s})" for s in input_shapes) + "]",
              "", "", "def get_init_inputs():",
              "    return [" + ", ".join(init_params) + "]", ""]
    return SynthModule(tuple(sorted(apis)), module_kind(ops), "\n".join(lines))


def _attr_name(op: Op, taken: list[str]) -> str:
    base = {"matmul": "linear", "rowmap": "norm"}.get(op.kind, "act")
    if op.api.endswith("Softmax"):
        base = "softmax"
    n = sum(1 for line in taken if line.strip().startswith(f"self.{base}"))
    return base if n == 0 else f"{base}{n + 1}"


def _describe(ops: Sequence[Op]) -> str:
    names = [op.api.rsplit(".", 1)[-1] for op in ops]
    return "Applies " + ", then ".join(names) + "."


class Synthesizer:
    """Draws API sets with the Proposer's sampler and writes a module for each."""

    def __init__(
        self,
        *,
        seed: int = 0,
        single_share: float = 0.2,
        catalog: ApiCatalog | None = None,
        frontier: Frontier | None = None,
    ) -> None:
        self.catalog = synth_catalog(catalog)
        self.sampler = ApiSetSampler(self.catalog, seed=seed, frontier=frontier)
        self.rng = random.Random(seed + 1)
        self._single_share = single_share
        singles = sorted(self.catalog.apis)
        self._singles = singles
        self._single_weights = [self.catalog.apis[a] ** 0.5 for a in singles]

    def api_set(self) -> list[str]:
        """One API set: a single API (``single_share`` of the time) or a catalog pair/triple."""
        if self.rng.random() < self._single_share:
            return self.rng.choices(self._singles, weights=self._single_weights)[0:1]
        return self.sampler.sample()

    def modules(self, count: int, *, max_tries: int = 100) -> Iterator[SynthModule]:
        """``count`` modules with distinct sources."""
        seen: set[str] = set()
        made = tries = 0
        while made < count:
            module = synthesize(self.api_set(), self.rng)
            if module.digest in seen:
                tries += 1
                if tries > max_tries * count:
                    raise RuntimeError(f"only {made} distinct modules after {tries} tries")
                continue
            seen.add(module.digest)
            made += 1
            yield module
