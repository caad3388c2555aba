"""Timing stability of the verifier's timing loop, for the A/A investigation (GPU only).

The A/A benchmark showed systematic per-process biases of up to +-48% on GEMM and
layer-norm modules (benchmarks/results/raw/verifier_2026-11-29.json), and in a diagnostic
run (log not kept) one GEMM timed 0.069 and 0.116 ms on two sets of buffers in one
process. This measures, per module, the spread (max - min) / min of the median time per
call over ``--sets`` independent sets of model and input buffers in one process, and over
``--fresh`` fresh processes, for each variant of the loop in ``VARIANTS``:

- flush ``zero`` (zero a buffer twice the L2 size, as Triton's ``do_bench``; leaves L2
  full of dirty lines) or ``read`` (sum it; leaves clean lines);
- ``pad`` off (the start event is recorded on an idle GPU, so the host's launch overhead
  falls between the events) or on (a GPU spin covers the issuing of the call);
- ``ring``: the outputs of the last calls are held so each call writes a different output
  block (without it the allocator hands every call the same block);
- ``zero_read``: zero one buffer, then sum another; ``xN``: a flush buffer N times L2
  (default 2).

The spread is reported for the event time (what the verifier ranks on) and, as
``call_ms``, for max(event time, issue time) (a rule tried and dropped: it lets host noise
back in).

The baseline is the earlier loop (``zero``, no pad), measured in the same run.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODULES = ["linear_relu", "bmm", "layernorm", "matmul", "relu", "small_matmul", "conv2d",
           "mean_dim", "log_softmax", "row_sum"]


# (flush, pad, rotate outputs, flush buffer size in multiples of L2); the first is the
# baseline.
VARIANTS = [("zero", False, False, 2), ("zero", True, True, 2), ("read", True, False, 2),
            ("read", True, True, 2), ("read", True, True, 4), ("read", True, True, 8),
            ("zero_read", True, True, 2)]


def variant_name(flush: str, pad: bool, ring: bool = False, factor: int = 2) -> str:
    return (f"{flush}{f'x{factor}' if factor != 2 else ''}{'+pad' if pad else ''}"
            f"{'+ring' if ring else ''}")


def median_times(name: str, buffer_sets: int, calls: int) -> dict[str, dict[str, list[float]]]:
    """Per variant: the median call, device and issue time (ms) of ``name`` on each of
    ``buffer_sets`` sets of buffers."""
    import torch

    from benchmarks.bench_verifier import aa_modules
    from kz_stream.verify._reference import strict_precision
    from kz_stream.verify._timing import L2Flusher, pad_for, timed_calls

    strict_precision()  # as the verifier's workers run
    path = Path(tempfile.mkdtemp(prefix="kz-timing-")) / f"{name}.py"
    path.write_text(aa_modules()[name])
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    flushers = {(f, k): L2Flusher(torch.device("cuda"), f, k)  # type: ignore[arg-type]
                for f, _, _, k in VARIANTS}
    out: dict[str, dict[str, list[float]]] = {
        variant_name(*v): {"call_ms": [], "event_ms": [], "issue_ms": []} for v in VARIANTS}
    keep = []
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
            pad, _ = pad_for(lambda m=model, a=sets[0]: m(*a))
            for f, p, ring, k in VARIANTS:
                samples, _ = timed_calls(lambda a, m=model: m(*a), sets, calls,
                                         flushers[(f, k)], pad_cycles=pad if p else 0,
                                         rotate_outputs=ring)
                o = out[variant_name(f, p, ring, k)]
                o["call_ms"].append(statistics.median(
                    max(e, i) for e, i in zip(samples.event_ms, samples.issue_ms, strict=True)))
                o["event_ms"].append(statistics.median(samples.event_ms))
                o["issue_ms"].append(statistics.median(samples.issue_ms))
    return out


def _in_process(args: tuple[str, int, int]) -> dict[str, dict[str, list[float]]]:
    return median_times(*args)


def spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / min(xs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modules", default=",".join(MODULES))
    ap.add_argument("--sets", type=int, default=4, help="buffer sets in one process")
    ap.add_argument("--fresh", type=int, default=3, help="fresh processes")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    raw: dict[str, Any] = {
        "_command": "python -m benchmarks.bench_timing " + " ".join(sys.argv[1:])}
    for name in args.modules.split(","):
        _save(raw, args.out)  # a run cut short keeps the modules it measured
        with ctx.Pool(1) as pool:
            one = pool.map(_in_process, [(name, args.sets, args.calls)])[0]
        fresh: list[dict[str, dict[str, list[float]]]] = []
        for _ in range(args.fresh):
            with ctx.Pool(1) as pool:
                fresh += pool.map(_in_process, [(name, 1, args.calls)])
        for variant in VARIANTS:
            v = variant_name(*variant)
            fr = [x[v]["call_ms"][0] for x in fresh]
            fr_ev = [x[v]["event_ms"][0] for x in fresh]
            raw[f"{name}/{v}"] = {
                "one_process_ms": one[v]["call_ms"], "fresh_processes_ms": fr,
                "one_process_event_ms": one[v]["event_ms"],
                "fresh_processes_event_ms": fr_ev,
                "one_process_issue_ms": one[v]["issue_ms"],
                "one_process_spread": spread(one[v]["call_ms"]),
                "fresh_processes_spread": spread(fr)}
            print(f"{name:12s} {v:9s}: event time, one process "
                  f"{spread(one[v]['event_ms']):.3f} {[round(x, 4) for x in one[v]['event_ms']]}"
                  f", fresh processes {spread(fr_ev):.3f} {[round(x, 4) for x in fr_ev]}; "
                  f"issue {[round(x, 4) for x in one[v]['issue_ms']]}", flush=True)
    _save(raw, args.out)
    write(raw)


def _save(raw: dict[str, Any], out: str | None) -> None:
    if out:
        from benchmarks._results import machine_description

        raw.setdefault("_machine", machine_description())
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "timing_raw.json").write_text(json.dumps(raw, indent=1))


def write(raw: dict[str, Any]) -> None:
    from benchmarks._results import metric, write_result

    m: dict[str, dict[str, Any]] = {}
    names = sorted({k.split("/")[0] for k in raw if not k.startswith("_")})

    def spreads(variant: str, key: str) -> list[float]:
        return [spread(raw[f"{n}/{variant}"][key]) for n in names
                if key in raw.get(f"{n}/{variant}", {})]

    # Event time (what the verifier ranks on), across buffer sets in one process; and the
    # dropped max(event, issue) rule, in one process and in fresh processes.
    for key, label in (("one_process_event_ms", "event_one_process"),
                       ("fresh_processes_event_ms", "event_fresh_processes"),
                       ("one_process_ms", "max_event_issue_one_process"),
                       ("fresh_processes_ms", "max_event_issue_fresh_processes")):
        base = spreads("zero", key)
        if not base:
            continue  # an earlier run did not keep this figure
        for variant in VARIANTS[1:]:
            v = variant_name(*variant)
            xs = spreads(v, key)
            if not xs:
                continue
            m[f"max_spread_{label}_{v}"] = metric(
                max(xs), "fraction (max over modules)", max(base))
            m[f"median_spread_{label}_{v}"] = metric(
                statistics.median(xs), "fraction (median over modules)",
                statistics.median(base))
    write_result("timing", raw.get("_command", "python -m benchmarks.bench_timing"), m,
                 notes="spread (max-min)/min of a module's median time per call over "
                       "independent buffer sets; baseline: zeroing flush without pad, same "
                       "run; modules: " + ", ".join(names), machine=raw.get("_machine"))


if __name__ == "__main__":
    from benchmarks._results import main_or_from_raw

    main_or_from_raw(main, write)
