"""The oracle: a persistent process per device that holds reference modules. It draws the
input sets from the verifier's secret seeds, computes the float64 expected outputs and the
honest same-precision outputs the tolerances are calibrated on, and times the reference
for the interleaved timing rounds. Candidates never run here.

Run as ``python -m kz_stream.verify.oracle <fd> <device>``.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import nn

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
from kz_stream.verify.timing import L2Flusher, timed_calls

_CACHE = 4  # reference problems kept loaded


class Loaded:
    """A reference problem held by the oracle."""

    def __init__(self, ref: ReferenceModule, model: nn.Module) -> None:
        self.ref = ref
        self.model = model
        self.timing_sets: list[list[Any]] = []
        self.flusher: L2Flusher | None = None


class Oracle:
    def __init__(self, device: str) -> None:
        self.device = device
        self.problems: OrderedDict[str, Loaded] = OrderedDict()

    def _get(self, key: str) -> Loaded:
        p = self.problems[key]
        self.problems.move_to_end(key)
        return p

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
        self.problems[key] = Loaded(ref, model)
        while len(self.problems) > _CACHE:
            self.problems.popitem(last=False)
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

    def time_setup(self, msg: dict[str, Any]) -> dict[str, Any]:
        p = self._get(str(msg["key"]))
        specs = [InputSpec(**s) for s in msg["specs"]]
        plan = InputPlan("timing", "normal")
        p.timing_sets = [make_inputs(specs, plan, int(msg["seed"]) + i, device=self.device)
                         for i in range(int(msg["sets"]))]
        p.flusher = L2Flusher(torch.device(self.device))
        outputs = []
        with torch.no_grad():
            for args in p.timing_sets:
                outputs.append([o.detach().to("cpu") if isinstance(o, torch.Tensor) else o
                                for o in flatten(p.model(*args))])
        torch.cuda.synchronize()
        return {"ok": True, "outputs": outputs, "l2_bytes": p.flusher.l2_bytes}

    def time(self, msg: dict[str, Any]) -> dict[str, Any]:
        p = self._get(str(msg["key"]))
        assert p.flusher is not None

        def call(args: Any) -> Any:
            with torch.no_grad():
                return p.model(*args)

        samples, _ = timed_calls(call, p.timing_sets, int(msg["calls"]), p.flusher,
                                 start=int(msg.get("start", 0)))
        return {"ok": True, "event_ms": samples.event_ms, "host_ms": samples.host_ms}

    def drop(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.problems.pop(str(msg["key"]), None)
        if self.device != "cpu":
            torch.cuda.empty_cache()
        return {"ok": True}


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
        "prepare": oracle.prepare, "time_setup": oracle.time_setup, "time": oracle.time,
        "drop": oracle.drop,
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
