"""The full-size corpus's GPU verdicts, from the logs its slots wrote
(``benchmarks/gpu_full_size_slot.sh LOG T``): how many honest kernels were judged
``correct``, how many cheats were accepted, and the honest kernels' speedups over eager
PyTorch (each measured by the verifier against the reference in the same verification).

    python -m benchmarks.full_size_corpus LOG... [--machine TEXT] [--command TEXT]

A later line for the same kernel replaces an earlier one (a slot that re-ran it). Kernels
of the corpus with no line are reported as not reached; the run is then incomplete and the
notes say so.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import Any

from benchmarks._results import metric, write_result
from kz_stream.testing.corpus.full_size import FULL_SIZE_CHEATS, FULL_SIZE_HONEST

_HONEST = re.compile(r"^RESULT full (\w+): (\w+) speedup=(\S+) ci=.* t=(\S+)")
_CHEAT = re.compile(r"^RESULT full cheat (\w+): (\w+) (\w+):")


def read_logs(paths: list[Path]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, str]]]:
    """The last honest and cheat verdict of each kernel named in ``paths``' RESULT lines."""
    honest: dict[str, dict[str, Any]] = {}
    cheats: dict[str, dict[str, str]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if m := _CHEAT.match(line):
                cheats[m[1]] = {"status": m[2], "check": m[3]}
            elif m := _HONEST.match(line):
                speedup = None if m[3] == "None" else float(m[3])
                seconds = None if m[4] == "None" else float(m[4])
                honest[m[1]] = {"status": m[2], "speedup": speedup, "seconds": seconds}
    return honest, cheats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--machine", default=None, help="where the logs were made")
    parser.add_argument("--command", default="benchmarks/gpu_full_size_slot.sh LOG T")
    parser.add_argument("--note", default="", help="appended to the notes")
    args = parser.parse_args()
    honest, cheats = read_logs(args.logs)
    correct = [n for n in FULL_SIZE_HONEST if honest.get(n, {}).get("status") == "correct"]
    wrong = sorted(n for n in FULL_SIZE_HONEST if n in honest and n not in correct)
    accepted = sorted(n for n in FULL_SIZE_CHEATS if cheats.get(n, {}).get("status")
                      == "correct")
    missing = sorted({*FULL_SIZE_HONEST} - honest.keys()) + sorted(
        f"cheat {n}" for n in {*FULL_SIZE_CHEATS} - cheats.keys())
    speedups = [honest[n]["speedup"] for n in correct if honest[n]["speedup"]]
    geomean = math.exp(sum(map(math.log, speedups)) / len(speedups)) if speedups else 0.0
    seconds = [honest[n]["seconds"] for n in honest if honest[n]["seconds"] is not None]
    metrics = {
        "honest kernels correct": metric(float(len(correct)), "kernels (target: all)",
                                         float(len(FULL_SIZE_HONEST))),
        "wrong verdicts on honest kernels": metric(float(len(wrong)), "verdicts (target 0)"),
        "cheats accepted": metric(float(len(accepted)), "cheats (target 0)",
                                  float(len(FULL_SIZE_CHEATS))),
        "geomean speedup of the correct honest kernels": metric(
            geomean, "x eager PyTorch", 1.0),
        "slowest verification": metric(max(seconds, default=0.0), "s"),
        "all verifications": metric(sum(seconds), "s"),
    }
    cheat_text = ", ".join(f"{n}: {c['status']} / {c['check']}" for n, c in sorted(
        cheats.items()))
    notes = (f"{len(FULL_SIZE_HONEST)} honest Triton kernels and {len(FULL_SIZE_CHEATS)} "
             "cheats at KernelBench's published sizes (kz_stream/testing/corpus/full_size.py),"
             " each verified alone by tests/verify/test_full_size_corpus.py on a GPU. "
             f"Wrong: {', '.join(wrong) or 'none'}. Cheats: {cheat_text or 'none run'}. "
             + (f"NOT REACHED: {', '.join(missing)}. " if missing else "All reached. ")
             + "Logs: " + ", ".join(str(p) for p in args.logs) + ". " + args.note).strip()
    write_result("full_size_corpus", args.command, metrics, notes=notes,
                 machine=args.machine)


if __name__ == "__main__":
    main()
