"""A problem as the oracle prepared it, as the verifier caches it, and the worker requests
that depend on it alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kz_stream.verify._compare import Tolerance
from kz_stream.verify._config import VerifierConfig
from kz_stream.verify._inputs import nbytes
from kz_stream.verify._ipc import share
from kz_stream.verify._messages import InputSet, ModelRequest, PrepareReply, TimeSetupRequest

__all__ = ["Prepared"]

# Expected and honest outputs of one set up to this size are kept on the comparison
# device between a candidate's runs; bigger ones are moved there block by block.
_DEVICE_CACHED_OUTPUT_BYTES = 256 << 20


def _held_bytes(sets: list[InputSet]) -> int:
    """What prepared ``sets`` hold on the host: each set's inputs and outputs, and the
    weights its model comes with (once per distinct model: a level-3 MLP's 2.7 GB)."""
    weights = sum(nbytes(list((s.get("state_dict") or {}).values())) for s in sets)
    return sum(int(s.get("bytes", 0)) for s in sets) + weights


@dataclass
class Prepared:
    """A problem as the oracle prepared it (CPU tensors), cached by the parent."""

    key: str
    source: str
    seed: int
    sets: list[InputSet]
    tolerances: list[list[Tolerance]]
    specs: list[dict[str, Any]]
    ref_ops: list[str]
    static_ops: frozenset[str]
    flops: int
    bytes: int
    input_bytes: int
    weight_seed: int
    own_model_key: str
    init_args: list[Any]
    notes: list[str]
    plan_notes: list[str]
    dropped: list[dict[str, str]]
    device_peak_bytes: int
    host_bytes: int
    # Where the preparation's time went: the oracle's phases, and "reply" (the wall time of
    # the oracle call beyond the oracle's own: the sets' trip to this process).
    phase_s: dict[str, float] = field(default_factory=dict)
    # Expected and honest outputs per (set, device), kept on a comparison device.
    on_device: dict[tuple[int, str], tuple[list[Any], list[Any]]] = field(
        default_factory=dict, repr=False)

    @staticmethod
    def from_reply(key: str, source: str, seed: int, static_ops: frozenset[str],
                   r: PrepareReply, call_s: float = 0.0) -> Prepared:
        """The oracle's ``r`` for the problem ``key`` (drawn from ``seed``), which took
        ``call_s`` seconds to come back."""
        phases = dict(r.get("phase_s") or {})
        if call_s and "oracle" in phases:
            phases["reply"] = round(max(call_s - phases["oracle"], 0.0), 3)
        return Prepared(
            key=key, source=source, seed=seed, sets=r["sets"],
            tolerances=[[Tolerance(**t) for t in s["tolerances"]] for s in r["sets"]],
            specs=r["specs"], ref_ops=r["ref_ops"], static_ops=static_ops,
            flops=int(r["flops"]), bytes=int(r["bytes"]), input_bytes=int(r["input_bytes"]),
            weight_seed=int(r["weight_seed"]), own_model_key=str(r["own_model_key"]),
            init_args=list(r["init_args"]), notes=list(r["notes"]),
            plan_notes=list(r.get("plan_notes", [])), dropped=list(r.get("dropped", [])),
            device_peak_bytes=int(r.get("device_peak_bytes", 0)),
            host_bytes=_held_bytes(r["sets"]), phase_s=phases)

    def share_inputs(self, min_bytes: int) -> None:
        """Moves each set's inputs of ``min_bytes`` and up into sealed memory files
        (``_ipc.share``): a worker then maps them instead of reading their bytes."""
        # id -> shared: a tensor given twice is one file. (An original freed once moved
        # frees its id, but every original looked up later was alive beside it.)
        done: dict[int, Any] = {}
        for s in self.sets:
            inputs = s["inputs"]
            for j, v in enumerate(inputs):  # one at a time: each copy freed once moved
                if id(v) not in done:
                    done[id(v)] = share(v, min_bytes)
                inputs[j] = done[id(v)]
            del v

    def set_summary(self) -> list[dict[str, Any]]:
        """Each input set checked: its label and input shapes."""
        return [{"label": s["label"], "shapes": s.get("shapes", [])} for s in self.sets]

    def state_dict(self, model_key: str) -> dict[str, Any] | None:
        """The weights of the model built with ``model_key``'s init args (sent once)."""
        return next((s["state_dict"] for s in self.sets if s["model_key"] == model_key
                     and s.get("state_dict") is not None), None)

    def model_request(self, key: str, init_args: list[Any]) -> ModelRequest:
        """Builds the model of ``init_args`` in a worker, with the reference's weights."""
        return {"cmd": "model", "key": key, "init_args": init_args,
                "weight_seed": self.weight_seed, "state_dict": self.state_dict(key)}

    def time_setup(self, config: VerifierConfig, seed: int, n_sets: int, *,
                   measure_pad: bool = False) -> TimeSetupRequest:
        """Sets a worker up for timing on ``n_sets`` sets drawn from ``seed``; the same for
        both sides but ``measure_pad`` (the reference's)."""
        msg: TimeSetupRequest = {
            "cmd": "time_setup", "specs": self.specs, "seed": seed, "sets": n_sets,
            "model": self.own_model_key, "flush": config.l2_flush,
            "flush_factor": config.l2_flush_factor}
        if measure_pad:
            msg["measure_pad"] = True
        return msg

    def outputs_on(self, i: int, device: str) -> tuple[list[Any], list[Any]]:
        """Expected and honest outputs of set ``i``, cached on ``device`` when small (a big
        one stays on the host: the comparison moves it block by block)."""
        s = self.sets[i]
        if nbytes(s["expected"]) + nbytes(s["honest"]) > _DEVICE_CACHED_OUTPUT_BYTES:
            return s["expected"], s["honest"]
        cached = self.on_device.get((i, device))
        if cached is None:
            cached = ([t.to(device) for t in s["expected"]],
                      [t.to(device) for t in s["honest"]])
            self.on_device[(i, device)] = cached
        return cached
