"""A module synthesizer: KernelBench-format modules composed from the API catalog.

API sets are drawn from the mined co-occurrence catalog (pairs and triples, plus single
APIs) restricted to the operations in ``kz_stream.warmstart.ops``, with the Proposer's
own sampler, so the frontier tilt is the same. Each set becomes one module: the ops in the
order their kinds allow (matmul, elementwise, whole-row, reduction), with shapes drawn per
module. The module's forward is one ``x = <call>`` line per op, which is what lets the
Triton teacher lower it back (``kz_stream.warmstart.teacher``).

Held-out modules are set aside by the hash of their source, so a measurement never sees a
module that SFT was trained on.

``teachable=False`` widens all of this to the Proposer-only ops (``PROPOSER_OPS``: sources,
image and sequence layers, shrinking ops, integer and loss outputs), so the Proposer learns
modules for the API sets it is really asked for, not only those the teacher lowers. The
teachable path is left exactly as it was: the same seed gives the same Coder modules.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections import Counter
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
# The order a module applies its ops in (the teacher's kinds keep their relative order).
_ORDER = {"source": 0, "spatial1d": 1, "spatial2d": 1, "matmul": 2, "unary": 3, "binary": 3,
          "rowmap": 4, "shrink": 5, "reduce": 6, "index": 6, "loss": 6}


@dataclass(frozen=True)
class SynthModule:
    """One synthesized module: its API set, kind and KernelBench-format source."""

    api_set: tuple[str, ...]
    kind: ModuleKind
    source: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()


_TERMINAL = ("reduce", "index", "loss")


def feasible(apis: Sequence[str], *, teachable: bool = True) -> bool:
    """Whether one module can call exactly these APIs (all known, one matmul, one reduction;
    without ``teachable``, also one source, one shrinking op, one image or sequence form)."""
    table = ops_by_api(teachable=teachable)
    if not apis or any(a not in table for a in apis):
        return False
    kinds: Counter[str] = Counter(table[a].kind for a in apis)
    if teachable:
        return kinds["matmul"] <= 1 and kinds["reduce"] <= 1
    spatial = kinds["spatial1d"] + kinds["spatial2d"]
    return (
        kinds["matmul"] <= 1 and sum(kinds[k] for k in _TERMINAL) <= 1
        and kinds["source"] <= 1 and kinds["shrink"] <= 1
        and not (kinds["spatial1d"] and kinds["spatial2d"])
        and not (kinds["source"] and spatial)
        and not ("torch.mm" in apis and spatial)  # mm takes 2-D inputs only
        and not ("torch.bmm" in apis and kinds["spatial2d"])  # bmm takes 3-D ones
    )


def synth_catalog(catalog: ApiCatalog | None = None, *, teachable: bool = True) -> ApiCatalog:
    """The catalog restricted to the API sets the synthesizer can build."""
    catalog = catalog or default_catalog()
    return ApiCatalog(
        apis={a: c for a, c in catalog.apis.items() if feasible([a], teachable=teachable)},
        pairs={k: c for k, c in catalog.pairs.items() if feasible(k, teachable=teachable)},
        triples={k: c for k, c in catalog.triples.items() if feasible(k, teachable=teachable)},
        meta={**catalog.meta, "restricted_to": "kz_stream.warmstart.ops"
              + ("" if teachable else " (with PROPOSER_OPS)")},
    )


def module_kind(ops: Sequence[Op]) -> ModuleKind:
    kinds = {op.kind for op in ops}
    if "matmul" in kinds:
        return "matmul"
    if kinds & set(_TERMINAL):
        return "reduction"
    if kinds & {"rowmap", "shrink"}:
        return "norm"
    return "single" if len(ops) == 1 else "fused"


def is_held_out(module: SynthModule, fraction: float) -> bool:
    """Whether a module belongs to the held-out share (a fixed function of its source)."""
    return int(module.digest[:8], 16) / 0xFFFFFFFF < fraction


def _ordered(apis: Sequence[str], rng: random.Random, *, teachable: bool = True) -> list[Op]:
    table = ops_by_api(teachable=teachable)
    ops = [table[a] for a in apis]
    rng.shuffle(ops)
    ops.sort(key=lambda op: _ORDER[op.kind])  # stable: elementwise stay shuffled
    # An elementwise op may also follow the whole-row part (unary ones after a reduction);
    # with the Proposer's ops only after a float reduction, never after an index or a loss,
    # and never one that reads an extra input shaped for the rows.
    after = ("rowmap", "reduce") if teachable else ("reduce",)
    tail = [op for op in ops if op.kind == "unary" and op.extra is None]
    if tail and any(op.kind in after for op in ops) and rng.random() < 0.3:
        moved = tail[-1]
        ops.remove(moved)
        ops.append(moved)
    return ops


_ROWS = (16, 32, 64, 128, 256)
_COLS = (64, 128, 256, 384, 512, 768, 1000, 1024, 2048)
_SEQ = (4, 8, 16)
_MM = (32, 64, 128, 256)
_K = (32, 64, 128, 256, 512)


def synthesize(apis: Sequence[str], rng: random.Random, *, teachable: bool = True) -> SynthModule:
    """Writes one module that calls exactly ``apis`` (which must be ``feasible``)."""
    if not feasible(apis, teachable=teachable):
        raise ValueError(f"no module calls exactly {sorted(apis)}")
    table = ops_by_api()
    if not teachable and not all(a in table for a in apis):
        return _synthesize_broad(apis, rng)
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
    source = _render(ops, consts, init_params, init_lines, body,
                     [(i, f"torch.randn({s})") for i, s in zip(inputs, input_shapes, strict=True)])
    return SynthModule(tuple(sorted(apis)), module_kind(ops), source)


def _render(ops: Sequence[Op], consts: Sequence[tuple[str, int]], init_params: Sequence[str],
            init_lines: Sequence[str], body: Sequence[str],
            inputs: Sequence[tuple[str, str]]) -> str:
    """The module's file: constants, ``Model``, ``get_inputs`` and ``get_init_inputs``."""
    sig = ", ".join(f"{p}: int" for p in init_params)
    lines = ["import torch", "import torch.nn as nn", ""]
    lines += [f"{name} = {value}" for name, value in consts]
    lines += ["", "", "class Model(nn.Module):",
              f'    """{_describe(ops)}"""', "",
              f"    def __init__(self{', ' + sig if sig else ''}):",
              "        super().__init__()", *init_lines, "",
              "    def forward(self, "
              + ", ".join(f"{name}: torch.Tensor" for name, _ in inputs) + ") -> torch.Tensor:",
              *body, "        return x", "", "",
              "def get_inputs():",
              "    return [" + ", ".join(expr for _, expr in inputs) + "]",
              "", "", "def get_init_inputs():",
              "    return [" + ", ".join(init_params) + "]", ""]
    return "\n".join(lines)


def _input_name(op: Op) -> str:
    extra = op.extra or ""
    if op.kind in ("source", "loss"):
        return "ids" if op.kind == "source" else "target"
    return "mask" if ">" in extra else "labels" if "randint(0, 3," in extra else "index"


def _grouped(expr: str) -> str:
    return f"({expr})" if " " in expr else expr


def _synthesize_broad(apis: Sequence[str], rng: random.Random) -> SynthModule:
    """``synthesize`` for sets with Proposer-only ops: the shape is tracked op by op."""
    ops = _ordered(apis, rng, teachable=False)
    kinds = {op.kind for op in ops}
    names = {op.api for op in ops}
    has_mm = "matmul" in kinds
    consts: list[tuple[str, int]] = [("batch_size", rng.choice((4, 8, 16)))]
    if "spatial2d" in kinds:
        consts += [("channels", rng.choice((8, 16, 32))), ("height", rng.choice((16, 32, 64))),
                   ("width", rng.choice((16, 32, 64)))]
    elif "spatial1d" in kinds:
        consts += [("channels", rng.choice((8, 16, 32))),
                   ("length", rng.choice((64, 128, 256, 512)))]
    else:
        consts[0] = ("batch_size", rng.choice(_ROWS))
        if "torch.bmm" in names or ("torch.mm" not in names and rng.random() < 0.25):
            consts.append(("seq_len", rng.choice(_SEQ)))
        consts.append(("in_features", rng.choice(_K)) if has_mm
                      else ("features", rng.choice(_COLS)))
    if "torch.nn.Embedding" in names:
        consts.append(("vocab_size", rng.choice((100, 1000, 5000))))
    if has_mm:
        consts.append(("out_features", rng.choice((*_MM, 512))))
    shape = [name for name, _ in consts if name not in ("vocab_size", "out_features")]

    inputs: list[tuple[str, str]] = []
    if "source" not in kinds:
        inputs.append(("x", f"torch.randn({', '.join(shape)})"))
    init_lines: list[str] = []
    body: list[str] = []

    def add_input(base: str, expr: str) -> str:
        taken = {name for name, _ in inputs}
        name = base if base not in taken else next(
            f"{base}{n}" for n in range(2, 99) if f"{base}{n}" not in taken)
        inputs.append((name, expr))
        return name

    for op in ops:
        w = shape[-1]
        fmt = {"w": w, "lead": ", ".join(shape[:-1]), "shape": ", ".join(shape), "n": w}
        attr = ""
        if op.module is not None:
            attr = _layer_name(op, init_lines)
            n = "out_features" if op.kind == "matmul" else w
            init_lines.append(f"        self.{attr} = {op.module.format(n=n, k=w)}")
        y = i = ""
        if op.kind == "matmul":
            if op.api != "torch.nn.Linear":
                y_shape = {"torch.nn.functional.linear": ["out_features", w],
                           "torch.bmm": [shape[0], w, "out_features"]}.get(
                               op.api, [w, "out_features"])
                y = add_input("w", f"torch.randn({', '.join(y_shape)})")
        elif "{y}" in op.torch:
            y = add_input("y", f"torch.randn({fmt['shape']})")
        if op.extra is not None:
            i = add_input(_input_name(op), op.extra.format(**fmt))
        body.append(f"        x = {op.torch.format(x='x', y=y, m=attr, i=i, w=w, n=w)}")
        if op.kind == "matmul":
            shape[-1] = "out_features"
        elif op.width is not None:
            shape[-1] = op.width.format(w=_grouped(w))
            if op.kind == "spatial2d":  # pools, pads and upsampling treat H as they treat W
                shape[-2] = op.width.format(w=_grouped(shape[-2]))
        elif op.kind in ("reduce", "index") and op.api != "torch.argsort":
            shape.pop()
        elif op.kind == "loss":
            shape = []
    used = set(re.findall(r"[a-z_]+", " ".join(init_lines)))
    init_params = [name for name, _ in consts if name in used]
    source = _render(ops, consts, init_params, init_lines, body, inputs)
    return SynthModule(tuple(sorted(apis)), module_kind(ops), source)


def _attr_name(op: Op, taken: list[str]) -> str:
    base = {"matmul": "linear", "rowmap": "norm"}.get(op.kind, "act")
    if op.api.endswith("Softmax"):
        base = "softmax"
    n = sum(1 for line in taken if line.strip().startswith(f"self.{base}"))
    return base if n == 0 else f"{base}{n + 1}"


def _layer_name(op: Op, taken: list[str]) -> str:
    words = r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])"  # BatchNorm2d -> batch_norm2d
    base = re.sub(words, "_", op.api.rsplit(".", 1)[-1]).lower()
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
        teachable: bool = True,
    ) -> None:
        self.teachable = teachable
        self.catalog = synth_catalog(catalog, teachable=teachable)
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
            module = synthesize(self.api_set(), self.rng, teachable=self.teachable)
            if module.digest in seen:
                tries += 1
                if tries > max_tries * count:
                    raise RuntimeError(f"only {made} distinct modules after {tries} tries")
                continue
            seen.add(module.digest)
            made += 1
            yield module
