"""The verifier's knobs: one validated model, which is also the ``[verifier]`` settings
section (``kz_stream.config``). Imports no torch, so settings load without it."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, model_validator

from kz_stream.verify._messages import FlushMode

__all__ = ["VerifierConfig"]


class VerifierConfig(BaseModel):
    """Knobs of the verifier. ``devices=None`` uses every visible GPU; ``[]`` forces the
    CPU path."""

    # A typo'd key is an error, not a knob silently left at its default.
    model_config = ConfigDict(extra="forbid", frozen=True)

    devices: list[NonNegativeInt] | None = Field(
        default=None, description="GPU indices; None: all visible; []: the CPU path."
    )
    build_jobs: int | None = Field(default=None, ge=1, description="Parallel CUDA compilers.")
    cache_dir: str | None = Field(default=None, description="Build cache; None: the default.")
    secret: bytes | None = Field(
        default=None, repr=False, description="HMAC key of verdict digests; None: random."
    )
    timing: bool = Field(
        default=True, description="Time candidates against the reference; false: correctness only."
    )
    time_budget_s: float = Field(default=1.5, gt=0, description="Per side, per candidate.")
    # Stop once the 95% interval's half-width is this relative.
    target_ci: float = Field(default=0.01, gt=0)
    min_rounds: int = Field(default=4, ge=1)
    max_rounds: int = Field(default=16, ge=1)
    round_ms: float = Field(default=40.0, gt=0, description="Device time of a round, per side.")
    # How L2 is evicted before each timed call (timing.L2Flusher): mode and buffer size in
    # multiples of L2. "zero_read" gave the steadiest A/A on the H200 (p90 0.75% against
    # 1.9% for "read" and 4.7% for an 8x "read"; docs/verifier.md).
    l2_flush: FlushMode = "zero_read"
    l2_flush_factor: int = Field(default=2, ge=1)
    call_timeout_s: float = Field(default=120.0, gt=0)
    load_timeout_s: float = Field(default=240.0, gt=0)
    prepare_timeout_s: float = Field(default=600.0, gt=0)
    own_share_min: float = Field(default=0.5, ge=0, le=1)
    fallback_policy: Literal["any", "majority"] = "any"
    floor_margin: float = Field(default=0.8, gt=0)
    worker_memory_fraction: float = Field(default=0.4, gt=0, le=1)
    oracle_memory_fraction: float = Field(default=0.4, gt=0, le=1)
    # Workers in the sandbox's jail (sandbox.isolation: a filesystem boundary, PID and
    # network namespaces); off, or where the host allows no mount namespace, a network
    # namespace only (stamped on verdicts: hardware["isolation"]).
    strong_isolation: bool = True
    # Address-space cap of a CPU-path worker (a memory bomb ends as its own "oom"); none on
    # a GPU, whose CUDA context reserves far more address space than it uses.
    cpu_worker_memory_mb: int | None = Field(default=16384, ge=1)
    # Host memory a worker's processes may hold during a request beyond the prepared
    # problem's (``Prepared.host_bytes``, what the harness hands it): over it, the worker
    # is killed and the candidate gets ``out_of_memory``; an OOM kill by the host's kernel
    # within it is the host's fault (``infra_error`` / ``host_memory``). None: no watch.
    worker_host_margin_bytes: int | None = Field(default=8 << 30, ge=0)
    # The oracle's big replies (16 MiB buffers and up) as sealed memory files the verifier
    # maps (``_ipc``; files under /dev/shm on a host without them) instead of the socket,
    # only while the candidates' workers are jailed. On this project's 2-core VM a 4 GiB
    # reply took 2.1 s so against 4.1 s through the socket (``benchmarks/bench_ipc.py``,
    # 2026-12-05).
    oracle_spill: bool = True
    # A prepared problem's inputs of this size and up are kept in sealed memory files
    # (``_ipc.share``), whose descriptors go to the workers instead of the bytes: a
    # candidate's run, ablation and profile each send the inputs again, and every sample
    # of a problem has a worker of its own. None: every input through the socket.
    input_share_min_bytes: int | None = Field(default=16 << 20, ge=1)
    # Workers started ahead of need, per device. None: two per slot on a GPU (a worker
    # takes seconds to start, and each candidate uses a fresh one), one on the CPU.
    prewarm: int | None = Field(default=None, ge=0)
    problem_cache: int = Field(default=16, ge=1)
    # A Triton candidate of a problem not yet prepared is imported and built on the meta
    # device in a CPU sandbox first (``_preflight``): a load or constructor error decides
    # its verdict without the preparation. "gpu": on a GPU only, where preparing costs
    # (``kz eval run`` chooses it unless set); off by default, since a training loop's
    # small modules prepare in about the time the preflight's two sandboxes take.
    preflight: Literal["off", "gpu", "on"] = "off"
    preflight_timeout_s: float = Field(default=60.0, gt=0)
    # Host bytes the prepared problems may hold together (least recently used dropped;
    # the newest is always kept), and the memory plan's budget for one problem's sets at
    # its own shapes (oracle.Oracle.prepare): a KernelBench ReLU's set holds 26 GB.
    # None: 48 GiB or a fifth of this host's memory, whichever is less.
    problem_cache_bytes: int | None = Field(default=None, ge=0)
    full_set_budget_bytes: int = Field(default=16 << 30, ge=0)
    # A verdict rests on at least this many input sets, one at the module's own shapes
    # (on a GPU), or it is not "correct": a dropped set is never a silent fallback.
    min_input_sets: int = Field(default=2, ge=1)
    # Problems whose reference stays loaded for timing, per GPU ...
    reference_workers: int = Field(default=4, ge=0)
    # ... and at most this many bytes of their timing inputs: a KernelBench-sized
    # reference holds two 6.4 GB sets, and four idle ones would fill a third of the GPU.
    reference_worker_bytes: int = Field(default=16 << 30, ge=0)
    # A request waiting for the host's memory (a problem's verifications) or for the
    # device's room (a candidate's stage, a preparation) is passed by later ones that fit
    # for at most this many seconds. Strictly in turn, on an H100 (2026-12-07), an RMS
    # norm with 7 GiB of inputs held 46.8 of the host's 51 GiB and its ten candidates ran
    # one at a time (43 GiB of the device's room each), 53-66 s apiece, while 25 problems
    # waited for host memory, among them six that need 0.7-5.3 GiB.
    pass_window_s: float = Field(default=30.0, ge=0)
    # Oracle processes per device (the CPU path counts as one): problems prepared at once.
    # A KernelBench problem's preparation is mostly host work, up to minutes; ``kz eval
    # run`` and ``kz verify audit-suite --jobs`` raise it on a GPU. Each oracle is capped
    # at ``oracle_memory_fraction`` of the device; one that finds the device full runs the
    # reference on the host (slower, same verdict).
    oracles: int = Field(default=1, ge=1)
    # Host bytes that the problems being verified at once may hold (each its preparation's
    # peak, estimated from the reference's sizes on the meta device: the oracle's sets and
    # the verifier's copy); one always runs. None: 40% of this host's memory. On the H200
    # host (125 GiB) an evaluation's process was killed for memory with two workers of a
    # 6.4 GB-input problem beside an oracle preparing another.
    host_budget_bytes: int | None = Field(default=None, ge=0)
    # Workers hand their device outputs of 16 MiB or more to the verifier by CUDA IPC
    # handle (copied device to device, ``_device_ipc``) rather than through the host: on
    # an H100 1.8 ms for 1 GiB against 0.50 s (a sealed file) and 1.03 s (the socket).
    # On since 2026-12-08: the GPU tests and the full-size mix judged every candidate
    # that handed outputs over so correctly on an H100 (docs/verifier.md); a copy that
    # fails is the verifier's own failure (infra_error), verified again, never a reward.
    output_handles: bool = True
    # Candidates in their GPU stage at once, per GPU: their checks overlap (one's Triton
    # JIT and host work with another's kernels); timing is exclusive all the same.
    candidates_per_gpu: int = Field(default=3, ge=1)
    # Also time the reference under torch.compile (GPU only), once per problem and GPU, the
    # first time a candidate of the problem is timed: its speedup over eager and the
    # candidate's against it go into the verdict's details (docs/verifier.md, "Compiled
    # baseline"). A failure is noted there and never changes a verdict.
    compiled_baseline: bool = False
    # torch.compile's mode for it (None: torch's default); an unknown one fails the
    # baseline of every problem (compiled_baseline_error), not the verdicts.
    compile_mode: str | None = None
    # The compiled reference's warm-up, where it compiles (Dynamo, Inductor, Triton).
    compile_timeout_s: float = Field(default=300.0, gt=0)
    static_scan: bool = True  # off only to test the run-time layer on its own
    launch_checks: bool = True  # off only for the A/A timing benchmark (reference vs itself)

    @model_validator(mode="after")
    def _rounds_in_order(self) -> Self:
        if self.max_rounds < self.min_rounds:
            raise ValueError(f"max_rounds {self.max_rounds} is below min_rounds {self.min_rounds}")
        return self

    def device_ids(self) -> list[int]:
        """The GPUs this verifier uses: ``devices``, or every visible one when None (none
        without CUDA)."""
        if self.devices is not None:
            return list(self.devices)
        import torch

        return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
