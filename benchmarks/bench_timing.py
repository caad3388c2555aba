"""Timing stability of the verifier's timing loop, for the A/A investigation (GPU only).

The A/A benchmark showed systematic per-process biases of up to +-48% on GEMM and
layer-norm modules (benchmarks/results/raw/verifier_2026-11-29.json), and in a diagnostic
run (log not kept) one GEMM timed 0.069 and 0.116 ms on two sets of buffers
in one process. This measures, per module, the spread (max - min) / min of the median
event time over K independent sets of model and input buffers, in one process and in K
fresh processes, for two L2 flushes:

- ``zero``: zero a buffer twice the L2 size (what ``kz_stream.verify.timing.L2Flusher``
  does, as Triton's ``do_bench``): leaves L2 full of dirty lines;
- ``read``: sum the same buffer: leaves L2 full of clean lines, so no write-back lands in
  the timed call.

The baseline of each spread is the ``zero`` flush's, measured in the same run.
Run: ``python -m benchmarks.bench_timing [--modules linear_relu,bmm,...] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODULES = ["linear_relu", "bmm", "layernorm", "matmul", "relu", "max_dim"]


def flusher(kind: str) -> Callable[[], None]:
    """The L2 flush of ``kind`` on the current CUDA device."""
    import torch

    from kz_stream.verify.timing import L2Flusher

    zero = L2Flusher(torch.device("cuda"))
    if kind == "zero":
        return zero
    sink = torch.empty((), dtype=torch.int64, device="cuda")

    def read() -> None:
        torch.sum(zero.buf, dim=0, dtype=torch.int64, out=sink)

    return read


def median_times(name: str, kind: str, buffer_sets: int, calls: int) -> list[float]:
    """Median event time (ms) of ``name`` on each of ``buffer_sets`` sets of buffers."""
    import torch

    from benchmarks.bench_verifier import aa_modules
    from kz_stream.verify.timing import timed_calls

    path = Path(tempfile.mkdtemp(prefix="kz-timing-")) / f"{name}.py"
    path.write_text(aa_modules()[name])
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    flush = flusher(kind)
    out, keep = [], []
    for k in range(buffer_sets):
        torch.manual_seed(k)
        model = mod.Model(*mod.get_init_inputs()).cuda()
        sets = [[x.cuda() if isinstance(x, torch.Tensor) else x for x in mod.get_inputs()]
                for _ in range(8)]
        keep.append((model, sets))  # new buffers for each set: nothing is freed and reused
        with torch.no_grad():
            for args in sets:
                model(*args)
            torch.cuda.synchronize()
            samples, _ = timed_calls(lambda a, m=model: m(*a), sets, calls, flush)
        out.append(statistics.median(samples.event_ms))
    return out


def _in_process(args: tuple[str, str, int, int]) -> list[float]:
    return median_times(*args)


def spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / min(xs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modules", default=",".join(MODULES))
    ap.add_argument("--sets", type=int, default=4, help="buffer sets (and fresh processes)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    raw: dict[str, Any] = {
        "_command": "python -m benchmarks.bench_timing " + " ".join(sys.argv[1:])}
    for name in args.modules.split(","):
        for kind in ("zero", "read"):
            with ctx.Pool(1) as pool:
                one = pool.map(_in_process, [(name, kind, args.sets, args.calls)])[0]
            fresh = []
            for _ in range(args.sets):
                with ctx.Pool(1) as pool:
                    fresh += pool.map(_in_process, [(name, kind, 1, args.calls)])[0]
            raw[f"{name}/{kind}"] = {"one_process_ms": one, "fresh_processes_ms": fresh,
                                     "one_process_spread": spread(one),
                                     "fresh_processes_spread": spread(fresh)}
            print(f"{name:12s} {kind}: in one process {spread(one):.3f} {one}; "
                  f"fresh processes {spread(fresh):.3f} {fresh}", flush=True)
    if args.out:
        from benchmarks._results import machine_description

        raw["_machine"] = machine_description()
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "timing_raw.json").write_text(json.dumps(raw, indent=1))
    write(raw)


def write(raw: dict[str, Any]) -> None:
    from benchmarks._results import metric, write_result

    m: dict[str, dict[str, Any]] = {}
    names = sorted({k.split("/")[0] for k in raw if not k.startswith("_")})
    for scope in ("one_process", "fresh_processes"):
        zero = [raw[f"{n}/zero"][f"{scope}_spread"] for n in names]
        read = [raw[f"{n}/read"][f"{scope}_spread"] for n in names]
        m[f"max_spread_{scope}_read_flush"] = metric(
            max(read), "fraction (max over modules)", max(zero))
        m[f"median_spread_{scope}_read_flush"] = metric(
            statistics.median(read), "fraction (median over modules)", statistics.median(zero))
    write_result("timing", raw.get("_command", "python -m benchmarks.bench_timing"), m,
                 notes="spread (max-min)/min of a module's median event time over independent "
                       "buffer sets; baseline: the zeroing L2 flush, same run; modules: "
                       + ", ".join(names), machine=raw.get("_machine"))


if __name__ == "__main__":
    from benchmarks._results import main_or_from_raw

    main_or_from_raw(main, write)
