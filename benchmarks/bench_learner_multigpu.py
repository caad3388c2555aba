"""The learner data-parallel over N processes (one GPU each; accelerate under torchrun).

The same groups are trained for one step on 1 and on N processes; the step's loss (the
mean of the processes' losses, which is what DDP's averaged gradient descends), its
gradient norm and the LoRA update must agree within tolerance, and step time is measured
against N for the same global batch. The groups are sampled once, by the driver, from the
policy itself (the real behaviour logprobs the importance correction needs).

Driver: ``python -m benchmarks.bench_learner_multigpu --gpus 1,2 [--model smollm2|tiny]
[--out DIR]``; it launches ``torchrun --standalone --nproc_per_node N -m
kz_stream.testing.data_parallel ...`` for each N (the harness the tests share).
``--model tiny --device cpu`` runs the same comparison on the CPU (gloo), as the test
suite does.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kz_stream.testing.data_parallel import add_arguments, compare, make_groups, run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    ap.add_argument("--gpus", default="1,2", help="process counts (one GPU each)")
    ap.add_argument("--groups-n", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="kz-ddp-"))
    work.mkdir(parents=True, exist_ok=True)
    groups_file = work / "groups.json"
    groups_file.write_text(json.dumps(make_groups(
        args.model, args.model_dir, "cuda:0" if args.device == "cuda" else "cpu",
        args.groups_n, args.group_size, args.new_tokens)))
    counts = [int(x) for x in args.gpus.split(",")]
    results = {n: run(n, args, str(groups_file), work) for n in counts}
    cmp = compare(results, work)
    raw = {"results": {str(k): v for k, v in results.items()},
           "compare": {str(k): v for k, v in cmp.items()}, "args": vars(args)}
    print(json.dumps(raw, indent=1), flush=True)
    (work / "learner_multigpu_raw.json").write_text(json.dumps(raw, indent=1))
    if args.out:
        from benchmarks._results import machine_description

        raw["_machine"] = machine_description()
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "learner_multigpu_raw.json").write_text(json.dumps(raw, indent=1))


def write(raw: dict[str, Any]) -> None:
    """Writes the result files from a raw run (on the machine that keeps the repo)."""
    from benchmarks._results import metric, write_result

    cmp = raw["compare"]
    one = cmp["1"]["step_s"]
    m: dict[str, dict[str, Any]] = {}
    for n, c in cmp.items():
        m[f"step_s_n{n}"] = metric(c["step_s"], "s per optimizer step (same global batch)",
                                   one if n != "1" else None)
        if n != "1":
            m[f"loss_abs_diff_n{n}"] = metric(c["loss_abs_diff"], "abs(loss_N - loss_1)")
            m[f"grad_norm_rel_diff_n{n}"] = metric(c["grad_norm_rel_diff"],
                                                   "abs(gnorm_N - gnorm_1) / gnorm_1")
            m[f"update_rel_diff_n{n}"] = metric(c["update_rel_diff"],
                                                "norm(dW_N - dW_1) / norm(dW_1), LoRA")
    a = raw["args"]
    write_result("learner_multigpu",
                 f"python -m benchmarks.bench_learner_multigpu --gpus {a['gpus']} --model "
                 f"{a['model']} --device {a['device']} --groups-n {a['groups_n']} --group-size "
                 f"{a['group_size']} --new-tokens {a['new_tokens']} --timed-steps "
                 f"{a['timed_steps']}", m,
                 notes=(f"{a['model']}, LoRA r=8, {a['groups_n']} groups x {a['group_size']} "
                        f"completions of up to {a['new_tokens']} tokens per step; "
                        "baseline of step time: 1 process")
                 + (f"; {raw['_note']}" if raw.get("_note") else ""),
                 machine=raw.get("_machine"))


if __name__ == "__main__":
    from benchmarks._results import main_or_from_raw

    main_or_from_raw(main, write)
