"""The oracle: a persistent process per device that evaluates reference modules. It draws
the input sets from the verifier's secret seeds, and computes the float64 expected outputs
and the honest same-precision outputs the tolerances are calibrated on. (The reference is
timed in a worker set up like a candidate's, not here.) Candidates never run here.

Run as ``python -m kz_stream.verify._oracle <fd> <device>``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

if __name__ == "__main__":
    from kz_stream.verify._lifeline import hold

    hold(int(sys.argv[1]))  # from the first moment: torch's import alone takes seconds

import torch

from kz_stream._cpus import usable_cpus
from kz_stream.verify._compare import all_finite, calibrate, flatten, unstable_limit
from kz_stream.verify._inputs import (
    InputPlan,
    InputSpec,
    at_own_shapes,
    default_plans,
    fallbacks,
    make_inputs,
    map_init,
    moved_bytes,
    nbytes,
    own_inputs,
    small_map,
)
from kz_stream.verify._ipc import error_reply, requests, sealed_copy, send
from kz_stream.verify._messages import (
    InputSet,
    PrepareReply,
    PrepareRequest,
    ReadyReply,
)
from kz_stream.verify._oplog import OpLog
from kz_stream.verify._phases import PhaseTimer
from kz_stream.verify._reference import (
    Float64Run,
    ReferenceModule,
    build_model,
    float64_copy,
    forget_built_models,
    host_copy,
    load_reference,
    run,
    strict_precision,
)


class Oracle:
    """Evaluates reference problems: input sets, float64 expected outputs, tolerances."""

    def __init__(self, device: str, *, sealed: bool = False) -> None:
        self.device = device
        # Whether the replies' big tensors are made as sealed files (``_ipc.sealed_copy``):
        # only for a verifier that takes files from this process (``KZ_SPILL_DIR`` set).
        self.sealed = sealed
        # Seconds per phase of the preparation in progress (``phase_s`` of the reply):
        # where a problem's preparation goes, summed over its input sets.
        self._phase = PhaseTimer(device)

    def prepare(self, msg: PrepareRequest) -> PrepareReply:
        """Input sets, expected and honest outputs, tolerances and cost figures.

        Memory plan: the sets at the module's own shapes together hold at most
        ``full_set_budget`` bytes (inputs, float64 expected and honest outputs, on the
        host); past it, a later plan runs at ⅛ of
        the shapes instead (said in ``plan_notes``). A float64 or honest run the device
        cannot hold runs on the host. A set that fails anyway is listed in ``dropped``
        with its reason."""
        key, seed = str(msg["key"]), int(msg["seed"])
        self._phase = PhaseTimer(self.device)
        started = time.monotonic()
        if self.device != "cpu":
            torch.cuda.reset_peak_memory_stats()
        budget = int(msg.get("full_set_budget") or 0)
        directory = os.path.join(os.getcwd(), key[:16])
        os.makedirs(directory, exist_ok=True)
        with self._phase("load"):
            ref = load_reference(msg["source"], directory)
            weight_seed = seed % (2**31)
            init = list(ref.get_init_inputs())
            own = own_inputs(ref.get_inputs, seed, self.device)
            specs = [InputSpec.of(v) for v in own]
            model = build_model(ref, init, weight_seed, self.device)
        sets: list[InputSet] = []
        notes: list[str] = []
        plan_notes: list[str] = []
        dropped: list[dict[str, str]] = []
        plans = default_plans(own, small_only=bool(msg.get("small_only")))
        on_device = self.device != "cpu"
        if on_device:
            # The sets need its room there; later plans want its shapes alone, and the op
            # log draws it again (milliseconds on a device; on the host it is kept).
            own = [torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v
                   for v in own]
        with_weights: set[str] = set()
        full_bytes = full_sets = 0
        for i, plan in enumerate(plans):
            if budget and at_own_shapes(plan.label) and full_sets >= 1 and full_bytes * (
                    full_sets + 1) / full_sets > budget:
                plan_notes.append(
                    f"{plan.label}: at 1/8 of the shapes (memory plan: {full_sets} full-size "
                    f"sets hold {full_bytes / 2**30:.1f} GiB; budget {budget / 2**30:.1f} GiB)")
                plan = InputPlan(plan.label + "@small", plan.dist, small_map(own),
                                 signed=plan.signed)
            done = None
            for attempt in [plan, *fallbacks(plan, own)]:
                try:
                    done = self._one_set(ref, init, specs, attempt, seed + 1000 * (i + 1),
                                         weight_seed, notes)
                    break
                except Exception as e:  # the reference rejects this shape: try a safer one
                    if _sticky_cuda_error(e):
                        raise  # the context is lost: no later set can run here
                    notes.append(f"{attempt.label}: {type(e).__name__}: {str(e)[:200]}")
                finally:
                    self._free()
            if done is None:
                dropped.append({"label": plan.label, "reason": notes[-1] if notes else ""})
                continue
            why = done.pop("drop")
            if why:
                notes.append(f"{plan.label}: dropped, {why}")
                dropped.append({"label": plan.label, "reason": why})
                continue
            if at_own_shapes(plan.label):
                full_sets += 1
                full_bytes += done["bytes"]
            if done["model_key"] in with_weights:
                done["state_dict"] = None  # sent once per distinct model
            with_weights.add(done["model_key"])
            sets.append(done)
        if not sets:
            raise RuntimeError("no input set could be evaluated: " + "; ".join(notes))
        # Ops the reference runs (for the candidate's fallback check) and its cost.
        own_args = own_inputs(ref.get_inputs, seed, self.device) if on_device else own
        oplog = OpLog()
        from torch.utils.flop_counter import FlopCounterMode

        flops = 0
        with self._phase("op_log_and_flops"):
            with torch.no_grad(), oplog:
                model(*own_args)
            try:
                with torch.no_grad(), FlopCounterMode(display=False) as counter:
                    out = model(*own_args)
                flops = int(counter.get_total_flops())
            except Exception:
                out = model(*own_args)
        input_bytes = nbytes(own_args)
        # The physical floor's bytes: what an honest kernel must move (``moved_bytes``).
        moved = moved_bytes(own_args) + moved_bytes(flatten(out))
        del own_args, out, model
        self._free()  # the oracle shares the device with the candidates: keep no cache
        peak = torch.cuda.max_memory_allocated() if self.device != "cpu" else 0
        phase_s = self._phase.rounded()
        phase_s["oracle"] = round(time.monotonic() - started, 3)
        return {"ok": True, "sets": sets, "phase_s": phase_s, "specs": [asdict(s) for s in specs],
                "ref_ops": sorted(oplog.ops), "flops": flops, "bytes": moved,
                "input_bytes": input_bytes, "weight_seed": weight_seed,
                "init_args": init, "own_model_key": repr(list(init)), "notes": notes,
                "plan_notes": plan_notes, "dropped": dropped, "device_peak_bytes": peak}

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the host, as the reply sends it: a big one straight into a sealed file
        (from the device, one copy where a host copy and the reply's write made two), and
        never a view of a bigger buffer: a loss's 0-dim output run on the host views its
        elementwise buffer (8 GiB in float64 for KernelBench's Huber loss, which the
        memory plan then counted as a second input set's worth and ran the other sets at
        an eighth of the shapes; H100 audit, 2026-12-06)."""
        out = sealed_copy(t) if self.sealed else t.to("cpu")
        return out.clone() if out.untyped_storage().nbytes() > out.nbytes else out

    def _free(self) -> None:
        if self.device != "cpu":
            torch.cuda.empty_cache()

    def _outputs(self, model: torch.nn.Module, inputs: list[Any], dtype: torch.dtype | None,
                 label: str, notes: list[str]) -> list[Any]:
        """``model`` (with ``dtype``, a copy of it in that precision) on ``inputs`` on the
        device, or on the host where the device cannot hold the run or the copy (float64 of
        a 6.4 GB input needs 13 GB more; of KernelBench level 3's 2.1 G-parameter MLP, 17 GB
        of weights beside its own 8.4: every set of it was dropped on an H100, 2026-12-06)."""
        try:
            return run(model if dtype is None else float64_copy(model), inputs, self.device,
                       dtype)
        except torch.OutOfMemoryError:
            if self.device == "cpu":
                raise
        self._free()
        notes.append(f"{label}: {'float64' if dtype else 'honest'} run on the host (the "
                     "device could not hold it)")
        host = host_copy(model, dtype)
        runnable = host if dtype is None else Float64Run(host, host)
        threads = torch.get_num_threads()
        torch.set_num_threads(max(threads, usable_cpus() // 2))
        try:
            return run(runnable, [v.to("cpu") if isinstance(v, torch.Tensor) else v
                              for v in inputs], "cpu", dtype)
        finally:
            torch.set_num_threads(threads)

    def _one_set(self, ref: ReferenceModule, init: list[Any], specs: list[InputSpec],
                 plan: InputPlan, seed: int, weight_seed: int,
                 notes: list[str]) -> InputSet:
        init_i = map_init(init, plan.size_map) if plan.scale_init else list(init)
        with self._phase("build"):
            model = build_model(ref, init_i, weight_seed, self.device)
        # Drawn on the device (fast); shipped to the candidate as CPU tensors.
        with self._phase("inputs"):
            inputs = make_inputs(specs, plan, seed, ref.get_inputs, device=self.device)
        with self._phase("honest"):
            honest = [self._to_host(torch.as_tensor(h))
                      for h in self._outputs(model, inputs, None, plan.label, notes)]
        with self._phase("float64"):
            expected = [self._to_host(torch.as_tensor(e))
                        for e in self._outputs(model, inputs, torch.float64, plan.label,
                                               notes)]
        if len(honest) != len(expected):
            raise RuntimeError("float64 run returns a different number of outputs")
        with self._phase("calibrate"):
            tols = [calibrate(e, h, self.device)
                    for e, h in zip(expected, honest, strict=True)]
        worst = max((t.honest_rel_norm for t in tols), default=0.0)
        drop = ""
        if worst > unstable_limit(honest) or any(t.dont_care_fraction > 0.01 for t in tols):
            drop = "honest error too large to calibrate"
        elif plan.signed and not all_finite(expected):
            drop = "the reference is not defined on inputs of both signs (non-finite outputs)"
        with self._phase("inputs_to_host"):
            cpu_inputs = [self._to_host(v) if isinstance(v, torch.Tensor) else v
                          for v in inputs]
        del inputs
        return {
            "label": plan.label,
            "inputs": cpu_inputs,
            "expected": expected,
            "honest": honest, "tolerances": [asdict(t) for t in tols],
            "init_args": init_i,
            "model_key": repr(list(init_i)),
            # Straight into sealed files where big, as the inputs: one host copy of a
            # level-3 MLP's 2.7 GB of weights, not a pageable one and then the reply's.
            "state_dict": {k: self._to_host(v.detach())
                           for k, v in model.state_dict().items()},
            "out_specs": [(list(h.shape), str(h.dtype).removeprefix("torch.")) for h in honest],
            "shapes": [list(v.shape) for v in cpu_inputs if isinstance(v, torch.Tensor)],
            "bytes": nbytes(cpu_inputs) + nbytes(expected) + nbytes(honest),
            "drop": drop,
        }


def _sticky_cuda_error(e: BaseException) -> bool:
    """A CUDA error that poisons the process's context (a device-side assert, an illegal
    address): every later CUDA call in this process fails too."""
    return "CUDA error" in str(e) or type(e).__name__ == "AcceleratorError"


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

    # Where the replies' big buffers go (``_ipc.send``): the verifier made it for this
    # process alone.
    spill = os.environ.get("KZ_SPILL_DIR") or None
    # The reference is the Proposer's code: no network, processes or writes outside here.
    Guard(allowed_programs=frozenset({"ptxas", "cc", "gcc", "ldconfig"}),
          channels=frozenset({conn.fileno()}),
          write_roots=(os.environ.get("KZ_PRIVATE_DIR", os.getcwd()), "/dev/shm",
                       *([spill] if spill else []))).install()
    oracle = Oracle(device, sealed=spill is not None)
    # Each takes its request (``_messages``) and returns its reply.
    handlers: dict[str, Callable[[Any], Mapping[str, Any]]] = {
        "prepare": oracle.prepare,
    }
    ready: ReadyReply = {"ready": True, "pid": os.getpid(), "device": device}
    send(conn, ready, spill)
    for msg in requests(conn):
        reply: Mapping[str, Any]
        try:
            reply = handlers[str(msg["cmd"])](msg)
        except BaseException as e:
            reply = error_reply(e)
            if _sticky_cuda_error(e):
                # Seen on the H200: one problem's device-side assert failed every later
                # problem in 2 ms. Exiting makes the verifier start a fresh oracle.
                send(conn, reply, spill)
                os._exit(3)
        forget_built_models()  # the host copy of this problem's model: the next is another
        send(conn, reply, spill)
        # Its sealed files are the verifier's now: this process's mappings and descriptors
        # go here, not with the next reply.
        del reply
    os._exit(0)


if __name__ == "__main__":
    main()
