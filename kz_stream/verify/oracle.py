"""The oracle: a persistent process per device that evaluates reference modules. It draws
the input sets from the verifier's secret seeds, and computes the float64 expected outputs
and the honest same-precision outputs the tolerances are calibrated on. (The reference is
timed in a worker set up like a candidate's, not here.) Candidates never run here.

Run as ``python -m kz_stream.verify.oracle <fd> <device>``.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

import torch

from kz_stream.verify.compare import calibrate, flatten, unstable_limit
from kz_stream.verify.inputs import (
    InputPlan,
    InputSpec,
    default_plans,
    fallbacks,
    make_inputs,
    map_init,
    nbytes,
)
from kz_stream.verify.ipc import recv, send
from kz_stream.verify.oplog import OpLog
from kz_stream.verify.reference import (
    ReferenceModule,
    build_model,
    float64_copy,
    load_reference,
    run,
    strict_precision,
)


class Oracle:
    """Evaluates reference problems: input sets, float64 expected outputs, tolerances."""

    def __init__(self, device: str) -> None:
        self.device = device

    def prepare(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Input sets, expected and honest outputs, tolerances and cost figures."""
        key, seed = str(msg["key"]), int(msg["seed"])
        directory = os.path.join(os.getcwd(), key[:16])
        os.makedirs(directory, exist_ok=True)
        ref = load_reference(msg["source"], directory)
        weight_seed = seed % (2**31)
        init = list(ref.get_init_inputs())
        torch.manual_seed(seed)
        own = list(ref.get_inputs())
        specs = [InputSpec.of(v) for v in own]
        model = build_model(ref, init, weight_seed, self.device)
        sets: list[dict[str, Any]] = []
        notes: list[str] = []
        plans = default_plans(own, small_only=bool(msg.get("small_only")))
        with_weights: set[str] = set()
        for i, plan in enumerate(plans):
            done = None
            for attempt in [plan, *fallbacks(plan, own)]:
                try:
                    done = self._one_set(ref, init, specs, attempt, seed + 1000 * (i + 1),
                                         weight_seed)
                    break
                except Exception as e:  # the reference rejects this shape: try a safer one
                    notes.append(f"{attempt.label}: {type(e).__name__}: {str(e)[:200]}")
            if done is None:
                continue
            if done.pop("unstable"):
                notes.append(f"{plan.label}: dropped, honest error too large to calibrate")
                continue
            if done["model_key"] in with_weights:
                done["state_dict"] = None  # sent once per distinct model
            with_weights.add(done["model_key"])
            sets.append(done)
        if not sets:
            raise RuntimeError("no input set could be evaluated: " + "; ".join(notes))
        # Ops the reference runs (for the candidate's fallback check) and its cost.
        own_args = [v.to(self.device) if isinstance(v, torch.Tensor) else v for v in own]
        oplog = OpLog()
        from torch.utils.flop_counter import FlopCounterMode

        flops = 0
        with torch.no_grad(), oplog:
            model(*own_args)
        try:
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                out = model(*own_args)
            flops = int(counter.get_total_flops())
        except Exception:
            out = model(*own_args)
        moved = nbytes(own_args) + nbytes(flatten(out))
        return {"ok": True, "sets": sets, "specs": [asdict(s) for s in specs],
                "ref_ops": sorted(oplog.ops), "flops": flops, "bytes": moved,
                "input_bytes": nbytes(own_args), "weight_seed": weight_seed,
                "init_args": init, "own_model_key": repr(list(init)), "notes": notes}

    def _one_set(self, ref: ReferenceModule, init: list[Any], specs: list[InputSpec],
                 plan: InputPlan, seed: int, weight_seed: int) -> dict[str, Any]:
        init_i = map_init(init, plan.size_map) if plan.scale_init else list(init)
        model = build_model(ref, init_i, weight_seed, self.device)
        # Drawn on the device (fast); shipped to the candidate as CPU tensors.
        inputs = make_inputs(specs, plan, seed, ref.get_inputs, device=self.device)
        honest = run(model, inputs, self.device)
        expected = run(float64_copy(model), inputs, self.device, torch.float64)
        if len(honest) != len(expected):
            raise RuntimeError("float64 run returns a different number of outputs")
        tols = [calibrate(e, h) for e, h in zip(expected, honest, strict=True)]
        worst = max((t.honest_rel_norm for t in tols), default=0.0)
        unstable = worst > unstable_limit(honest) or any(t.dont_care_fraction > 0.01
                                                         for t in tols)
        cpu = [h.to("cpu") if isinstance(h, torch.Tensor) else torch.as_tensor(h)
               for h in honest]
        return {
            "label": plan.label,
            "inputs": [v.to("cpu") if isinstance(v, torch.Tensor) else v for v in inputs],
            "expected": [e.to("cpu") if isinstance(e, torch.Tensor) else torch.as_tensor(e)
                         for e in expected],
            "honest": cpu, "tolerances": [asdict(t) for t in tols],
            "init_args": init_i,
            "model_key": repr(list(init_i)),
            "state_dict": {k: v.detach().to("cpu") for k, v in model.state_dict().items()},
            "out_specs": [(list(h.shape), str(h.dtype).removeprefix("torch.")) for h in cpu],
            "unstable": unstable,
        }


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    strict_precision()
    torch.set_num_threads(int(os.environ.get("KZ_ORACLE_THREADS", "4")))
    if device != "cpu":
        torch.cuda.set_device(0)
        torch.empty(1, device=device)
        torch.cuda.set_per_process_memory_fraction(
            float(os.environ.get("KZ_ORACLE_MEMORY_FRACTION", "0.45")))
    from kz_stream.verify._guard import Guard

    # The reference is the Proposer's code: no network, processes or writes outside here.
    Guard(allowed_programs=frozenset({"ptxas", "cc", "gcc", "ldconfig"}),
          write_roots=(os.environ.get("KZ_PRIVATE_DIR", os.getcwd()), "/dev/shm")).install()
    oracle = Oracle(device)
    handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
        "prepare": oracle.prepare,
    }
    send(conn, {"ready": True, "pid": os.getpid(), "device": device})
    while True:
        try:
            msg = recv(conn)
        except (EOFError, OSError):
            break
        if msg.get("cmd") == "exit":
            break
        try:
            reply = handlers[str(msg["cmd"])](msg)
        except BaseException as e:
            text = "".join(traceback.format_exception_only(type(e), e)).strip()
            reply = {"ok": False, "error": "exception", "message": text[-3000:],
                     "traceback": traceback.format_exc()[-6000:]}
        send(conn, reply)
    os._exit(0)


if __name__ == "__main__":
    main()
