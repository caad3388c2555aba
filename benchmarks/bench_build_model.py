"""Building a reference model with many weights, as the oracle and admission do.

The oracle builds the reference once when it loads a problem and once per input set
(``Oracle._one_set``), admission twice; each build draws every weight twice (the module's
own initialisation, then ``perturb_``'s seeded noise). For KernelBench level 3's MLP
(671M parameters) that was the larger part of its 90 s admission and 216 s preparation on
the H200 host (``docs/verifier.md``, audit of 2026-12-01). This times, on the module at
that size (written here; the project ships no KernelBench):

- ``perturb_`` against its first form (the same values, with copies of the weight where
  the rewrite works in place);
- a first build, and a build of the same model again (a copy of the first), against a
  build with nothing kept (every build as before);
- the builds of one oracle preparation, in its order: on loading, then one per default
  input set (``default_plans``: own, signed, normal and heavy at the module's own init
  arguments; odd and small with their own, scaled ones, so built afresh either way),
  with and without the kept copy.

    python -m benchmarks.bench_build_model [--width 16384] [--threads 4]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn

from benchmarks._results import metric, write_result
from kz_stream.testing.perturb import perturb_first_form
from kz_stream.verify._inputs import default_plans, map_init
from kz_stream.verify._reference import (
    ReferenceModule,
    build_model,
    forget_built_models,
    perturb_,
)


class MLP(nn.Module):
    """KernelBench level 3, problem 1's shape: two hidden layers, then the output."""

    def __init__(self, width: int, hidden: list[int], out: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, out))
        self.network = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.network(x)
        return out


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=4, help="torch threads (the oracle's 4)")
    ap.add_argument("--machine", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    w = args.width
    init = [w, [w, w], w // 2]
    ref = ReferenceModule(MLP, lambda: [torch.rand(128, w)], lambda: init)
    build_model(ReferenceModule(MLP, list, lambda: [64, [64], 32]), [64, [64], 32], 5, "cpu")

    def perturb_times() -> tuple[float, float, int]:
        torch.manual_seed(0)
        model = MLP(*init)
        first_form = _timed(lambda: perturb_first_form(model, 1))
        now = _timed(lambda: perturb_(model, 1))
        return first_form, now, sum(p.numel() for p in model.parameters())

    first_form, now, params = perturb_times()
    print(f"{params / 1e6:.0f}M parameters; perturb_: first form {first_form:.1f} s, "
          f"now {now:.1f} s", flush=True)

    def uncached() -> None:
        forget_built_models()
        build_model(ref, init, 5, "cpu")

    plain = _timed(uncached)
    forget_built_models()
    first = _timed(lambda: build_model(ref, init, 5, "cpu"))
    again = min(_timed(lambda: build_model(ref, init, 5, "cpu")) for _ in range(3))
    forget_built_models()
    print(f"build with nothing kept {plain:.1f} s; first build {first:.1f} s; "
          f"again {again:.2f} s", flush=True)
    own = list(ref.get_inputs())
    builds = [init] + [map_init(init, plan.size_map) if plan.scale_init else list(init)
                       for plan in default_plans(own)]

    def oracle_builds(keep: bool) -> None:
        for args in builds:
            if not keep:
                forget_built_models()
            build_model(ref, args, 5, "cpu")
        forget_built_models()

    oracle_then, oracle_now = _timed(lambda: oracle_builds(False)), _timed(
        lambda: oracle_builds(True))
    print(f"an oracle's {len(builds)} builds: {oracle_then:.1f} s with nothing kept, "
          f"{oracle_now:.1f} s now", flush=True)
    metrics = {
        "perturb_, 671M-parameter MLP" if w == 16384 else f"perturb_, width {w}":
            metric(now, "s", first_form),
        "first build": metric(first, "s", plain),
        "build of the same model again": metric(again, "s", plain),
        f"an oracle preparation's {len(builds)} builds": metric(oracle_now, "s", oracle_then),
    }
    write_result(
        "build_model",
        f"python -m benchmarks.bench_build_model --width {w} --threads {args.threads}",
        metrics,
        notes=(f"{params / 1e6:.0f}M parameters (KernelBench level 3 problem 1's MLP at width "
               f"{w}), on the host, {args.threads} torch threads. Baselines: perturb_'s "
               "first form; a build with nothing kept (as every build was before this change, "
               "with perturb_ as it is now). "
               f"The oracle's builds, timed in its order: {len(builds)}, of which the "
               "odd and small input sets' have init arguments of their own (odd: every "
               "size one less; small: an eighth), so only the own-shaped sets' builds are "
               "copies."),
        machine=args.machine,
    )


if __name__ == "__main__":
    main()
