"""One run spread over GPU slots, its store and checkpoints carried off the host and back
between them: what each slot did, and whether any event was lost or applied twice
(``kz_stream.integrity.check_slots`` says what counts).

    python -m benchmarks.gpu_loop_slots sqlite+aiosqlite:///run.sqlite3 [--run-id RUN] \\
        --machine "1x H200" --command "benchmarks/gpu_loop_slot.sh ..."

Writes benchmarks/results/gpu_loop_slots.json and docs/benchmarks.md; exits 1 when
something was lost or applied twice.
"""

from __future__ import annotations

import argparse
import asyncio

from benchmarks._results import metric, write_result
from kz_stream.integrity import check_slots, load_events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", help="The run's store URL.")
    ap.add_argument("--run-id", default=None)
    ap.add_argument("--gap", type=float, default=90.0,
                    help="Seconds without an event that separate two slots.")
    ap.add_argument("--machine", default=None)
    ap.add_argument("--command", default="")
    ap.add_argument("--notes", default="")
    args = ap.parse_args()
    try:
        run_id, events = asyncio.run(load_events(args.store, args.run_id))
    except LookupError as e:
        raise SystemExit(f"{e} (--run-id)") from None
    r = check_slots(events, args.gap)
    for i, s in enumerate(r["slots"], start=1):
        print(f"slot {i}: {s['seconds']:.0f} s, {s.get('kernels', 0)} kernels, "
              f"{s.get('verdicts', 0)} verdicts ({s.get('verdicts_of_earlier_slots', 0)} of "
              f"kernels from earlier slots), Coder steps {s.get('coder_steps', 0)}, Proposer "
              f"steps {s.get('proposer_steps', 0)}")
    print(f"run {run_id}: {r['kernels']} kernels, {r['verdicts']} verdicts, lost "
          f"{len(r['lost'])}, in flight at the end {r['in_flight_at_end']}, generated twice "
          f"{len(r['generated_twice'])}, verified twice {len(r['verified_twice'])}")
    print(f"schedule: {r['schedule']}")
    for role, x in r["roles"].items():
        print(f"{role}: {x}")
    print(f"trained on twice: { {k: len(v) for k, v in r['trained_twice'].items()} }")
    print("OK: no event lost or applied twice" if r["ok"] else "NOT OK")
    carried = sum(s.get("verdicts_of_earlier_slots", 0) for s in r["slots"])
    twice = (len(r["generated_twice"]) + len(r["verified_twice"])
             + sum(len(v) for v in r["trained_twice"].values())
             + len(r["schedule"]["steps_repeated"])
             + sum(len(x["versions_repeated"]) for x in r["roles"].values()))
    metrics = {
        "slots": metric(len(r["slots"]), "slots"),
        "kernels": metric(r["kernels"], "kernels"),
        "verdicts": metric(r["verdicts"], "verdicts"),
        "verdicts_of_earlier_slots": metric(carried, "verdicts"),
        "coder_steps": metric(r["roles"]["coder"]["steps"], "steps"),
        "proposer_steps": metric(r["roles"]["proposer"]["steps"], "steps"),
        "lost": metric(len(r["lost"]), "events"),
        "applied_twice": metric(twice, "events"),
        "in_flight_at_end": metric(r["in_flight_at_end"], "kernels"),
    }
    path = write_result("gpu_loop_slots", args.command or "python -m benchmarks.gpu_loop_slots",
                        metrics, notes=args.notes, machine=args.machine)
    print(f"wrote {path}")
    raise SystemExit(0 if r["ok"] else 1)


if __name__ == "__main__":
    main()
