"""The verifier's per-problem sandbox calls with their imports paid ahead, against a fresh
child each time.

Before a problem's first candidate is judged, the verifier runs ``reference_facts`` (the
reference's init arguments and its inputs' and outputs' bytes) and then each candidate's
``candidate_preflight``, each in a sandboxed child of its own; a child that starts cold
imports torch first (7-11 s a problem on an H200 host in a GPU loop, 2026-12-04). With
``preload``, a call takes a child started earlier that has imported them already. The
calls come ``--gap`` seconds apart, as a stream of problems does; the first two warm calls
of each target are left out: the first target's start the spares (a kind gets them from its
second call on), and the two targets, one module with one preload list, are one kind, so
the second's find spares waiting and dropping them only costs two samples.

The admission check (``admission_check``: each proposal's validation runs it after its
probe, and an audit for every problem) is measured the same way with ``--targets
admission``, written apart (``sandbox_preload_admission``) since it runs on the CPU path.

Run: ``python -m benchmarks.bench_sandbox_preload [--calls 6] [--gap 3] [--targets ...]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks._results import metric, write_result
from kz_stream.verify._admission import IMPORTS as ADMISSION_IMPORTS
from kz_stream.verify._preflight import IMPORTS
from kz_stream.verify._sandbox import run_in_sandbox

PROBLEM = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return torch.softmax(x, dim=self.dim)


def get_inputs():
    return [torch.rand(4096, 8192)]


def get_init_inputs():
    return [1]
'''

CANDIDATE = '''
import torch
import triton
import triton.language as tl


class ModelNew(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return torch.softmax(x, dim=self.dim)
'''


# A small module: the check's own work is a fraction of a second, its child's start is not.
SMALL_PROBLEM = PROBLEM.replace("torch.rand(4096, 8192)", "torch.rand(64, 128)")


def timed_calls(target: str, args: tuple[object, ...], preload: tuple[str, ...], calls: int,
                gap_s: float, memory_mb: int = 4096) -> list[float]:
    times = []
    for _ in range(calls):
        t0 = time.monotonic()
        out = run_in_sandbox(target, args, timeout_s=120, memory_mb=memory_mb,
                             preload=preload)
        times.append(time.monotonic() - t0)
        if not out.ok:
            raise SystemExit(f"{target} failed: {out.error_kind} {out.error_message}")
        time.sleep(gap_s)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--gap", type=float, default=3.0, help="Seconds between calls.")
    ap.add_argument("--machine", default=None)
    ap.add_argument("--targets", default="preflight",
                    help="preflight (reference_facts and candidate_preflight) or admission")
    args = ap.parse_args()
    metrics = {}
    targets = {
        "preflight": [
            ("reference_facts", "kz_stream.verify._preflight:reference_facts", (PROBLEM,),
             IMPORTS),
            ("candidate_preflight", "kz_stream.verify._preflight:candidate_preflight",
             (CANDIDATE, [1]), IMPORTS)],
        # admission_check's own sandbox call, as module validation makes it (CPU, 16 GB).
        "admission": [("admission_check", "kz_stream.verify._admission:_admit",
                       (SMALL_PROBLEM, "cpu"), ADMISSION_IMPORTS)],
    }[args.targets]
    memory_mb = 16384 if args.targets == "admission" else 4096
    for name, target, call_args, imports in targets:
        cold = timed_calls(target, call_args, (), args.calls, args.gap, memory_mb)
        warm = timed_calls(target, call_args, imports, args.calls + 2, args.gap,
                           memory_mb)[2:]
        c, w = statistics.median(cold), statistics.median(warm)
        print(f"{name}: fresh child {c:.2f} s (median of {len(cold)}; {min(cold):.2f}-"
              f"{max(cold):.2f}), imports paid ahead {w:.2f} s ({min(warm):.2f}-"
              f"{max(warm):.2f}): {c / w:.1f}x")
        metrics[f"{name}, imports paid ahead (median)"] = metric(round(w, 3), "s", round(c, 3))
    suffix = "" if args.targets == "preflight" else f"_{args.targets}"
    path = write_result(
        f"sandbox_preload{suffix}", f"python -m benchmarks.bench_sandbox_preload --calls "
        f"{args.calls} --gap {args.gap:g} --targets {args.targets}", metrics,
        machine=args.machine,
        notes="baseline: a fresh sandboxed child per call (it imports torch first); ratio "
        "below 1 is faster")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
