"""The messages between the verifier and its children (candidate workers and the oracle).

One definition per message, used on both sides: the parent builds requests and reads
replies with these types, the children read requests and build replies with them. On the
wire they are plain dicts (pickled over the child's socket, ``_ipc``); tensors travel as
CPU tensors (typed ``Any`` here, so that this module imports no torch).
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

__all__ = [
    "AblateReply",
    "AblateRequest",
    "BuildManifest",
    "ErrorReply",
    "FinishReply",
    "FinishRequest",
    "FlushMode",
    "ImportedReply",
    "InputSet",
    "KernelEvent",
    "LoadReply",
    "LoadRequest",
    "ModelReply",
    "ModelRequest",
    "OracleRequest",
    "OutSpec",
    "PrepareReply",
    "PrepareRequest",
    "ProfileReply",
    "ProfileRequest",
    "ReadyReply",
    "Request",
    "RunReply",
    "RunRequest",
    "StartRequest",
    "TimeReply",
    "TimeRequest",
    "TimeSetupReply",
    "TimeSetupRequest",
    "WarmReply",
    "WorkerRequest",
]

OutSpec = tuple[list[int], str]  # an expected output's shape and dtype name
# How L2 is evicted before each timed call (``_timing.L2Flusher``).
FlushMode = Literal["read", "zero", "zero_read"]


# ---- start-up and shutdown ---------------------------------------------------------------


class ImportedReply(TypedDict):
    """A gated worker has imported its modules and waits for ``StartRequest``."""

    imported: bool


class StartRequest(TypedDict):
    """Lets a gated worker touch the device (create its CUDA context, warm Triton up)."""

    cmd: Literal["start"]


class ReadyReply(TypedDict):
    """A child has started; a worker says where its start-up time went (``start_s``) and
    whether its host-side warm-up is still running (``warming``: a ``WarmReply`` follows).
    A failed start sends ``ready`` false with an ``ErrorReply``'s fields."""

    ready: bool
    pid: NotRequired[int]
    device: NotRequired[str]
    start_s: NotRequired[dict[str, float]]
    gpu: NotRequired[str]
    warming: NotRequired[bool]
    # The CPU path's Triton interpreter failed the worker's self-check: the error it raised.
    interpreter_defect: NotRequired[str]
    ok: NotRequired[bool]
    error: NotRequired[str]
    message: NotRequired[str]
    traceback: NotRequired[str]


class WarmInfo(TypedDict):
    start_s: dict[str, float]


class WarmReply(TypedDict):
    """A worker's host-side warm-up is done; ``info`` completes its ``ReadyReply``."""

    warm: bool
    info: WarmInfo


class ExitRequest(TypedDict):
    cmd: Literal["exit"]


class _Reply(TypedDict):
    """What every worker reply has: whether the request succeeded, and the sandbox rules
    the candidate broke so far (added by the worker's loop)."""

    ok: bool
    violations: NotRequired[list[str]]


class ErrorReply(_Reply):
    """A request failed: ``error`` is oom, compile_error, cuda_error, forbidden or
    exception."""

    error: str
    message: str
    traceback: NotRequired[str]


# ---- candidate worker --------------------------------------------------------------------


class BuildManifest(TypedDict):
    """A CUDA extension built ahead of time, handed to the candidate for its
    ``load_inline`` call (``_build.BuildResult.manifest``)."""

    key: str
    name: str
    layout: str | None
    path: str | None
    namespace: str | None
    functions: list[str]
    mod_name: str


class LoadRequest(TypedDict):
    """Loads the candidate's (or, for timing, the reference's) module."""

    cmd: Literal["load"]
    source: str
    builds: list[BuildManifest]


class LoadReply(_Reply):
    triton_kernels: list[str]
    changed: list[str]  # bindings the module rebound at import
    precision: dict[str, Any]


class ModelRequest(TypedDict):
    """Builds ``ModelNew(*init_args)`` under the weight seed, with the reference's weights
    when they fit; ``compile`` wraps it in ``torch.compile`` (mode ``compile_mode``) once
    they are loaded (the reference's compiled baseline)."""

    cmd: Literal["model"]
    key: str
    init_args: list[Any]
    weight_seed: int
    state_dict: dict[str, Any] | None
    compile: NotRequired[bool]
    compile_mode: NotRequired[str | None]


class ModelReply(_Reply):
    weights_loaded: bool
    param_count: int


class _OnSet(TypedDict):
    """A request that calls the model ``model`` on one input set."""

    inputs: list[Any]
    out_specs: list[OutSpec]  # the expected outputs' (to poison freed blocks of their size)
    model: str
    set: NotRequired[int]  # the set's index: the worker keeps set 0 on its device


class RunRequest(_OnSet):
    """Runs one input set ``reps`` times with the per-call checks."""

    cmd: Literal["run"]
    reps: NotRequired[int]
    log_ops: NotRequired[bool]


class RunReply(_Reply):
    outputs: list[list[Any]]  # one list of CPU outputs per repetition
    flags: list[str]
    ops: list[str]
    launches: dict[str, int]


class ProfileRequest(TypedDict):
    cmd: Literal["profile"]
    inputs: list[Any]
    set: NotRequired[int]
    calls: int
    model: str
    pad_cycles: int


class KernelEvent(TypedDict):
    """One device activity of the profiler's trace."""

    name: str
    us: float
    ts: float
    stream: Any
    cat: str | None


class ProfileReply(_Reply):
    kernels: list[KernelEvent]
    launches: dict[str, int]


class AblateRequest(_OnSet):
    """Outputs with each of ``kernels`` disabled in turn; ``other_inputs`` run before each."""

    cmd: Literal["ablate"]
    kernels: list[str]
    other_inputs: list[Any] | None


class AblateReply(_Reply):
    outputs: dict[str, list[Any]]  # "error: ..." strings where the ablated call raised


class TimeSetupRequest(TypedDict):
    """Draws the timing sets and warms the model up; the reference measures the pad."""

    cmd: Literal["time_setup"]
    specs: list[dict[str, Any]]
    seed: int
    sets: int
    model: str
    flush: FlushMode
    flush_factor: int
    measure_pad: NotRequired[bool]


class TimeSetupReply(_Reply):
    pad_cycles: int
    pad_ms: float


class TimeRequest(TypedDict):
    """One timed round: ``calls`` calls from call index ``start``, keeping the outputs of
    the calls in ``keep``."""

    cmd: Literal["time"]
    calls: int
    start: int
    keep: list[int]
    pad_cycles: NotRequired[int]


class TimeReply(_Reply):
    event_ms: list[float]
    host_ms: list[float]
    issue_ms: list[float]
    outputs: dict[int, list[Any]]


class FinishRequest(TypedDict):
    cmd: Literal["finish"]


class FinishReply(_Reply):
    changed: list[str]
    threads: int
    native_threads: int
    native_threads_at_load: int
    precision: dict[str, Any]
    writes: list[str]


WorkerRequest = (LoadRequest | ModelRequest | RunRequest | ProfileRequest | AblateRequest
                 | TimeSetupRequest | TimeRequest | FinishRequest)


# ---- oracle ------------------------------------------------------------------------------


class PrepareRequest(TypedDict):
    """Evaluates a reference: input sets from ``seed``, expected and honest outputs."""

    cmd: Literal["prepare"]
    source: str
    key: str
    seed: int
    small_only: bool
    full_set_budget: int


class InputSet(TypedDict):
    """One input set of a prepared problem, with the reference's outputs on it."""

    label: str
    inputs: list[Any]
    expected: list[Any]  # float64
    honest: list[Any]  # the reference at its own precision
    tolerances: list[dict[str, float]]  # _compare.Tolerance fields, per output
    init_args: list[Any]
    model_key: str
    state_dict: dict[str, Any] | None  # sent once per distinct model
    out_specs: list[OutSpec]
    shapes: list[list[int]]
    bytes: int
    drop: NotRequired[str]  # why the oracle drops it ("" to keep it)


class PrepareReply(TypedDict):
    ok: bool
    sets: list[InputSet]
    specs: list[dict[str, Any]]  # _inputs.InputSpec fields, per input
    ref_ops: list[str]
    flops: int
    bytes: int
    input_bytes: int
    weight_seed: int
    init_args: list[Any]
    own_model_key: str
    notes: list[str]
    plan_notes: list[str]
    dropped: list[dict[str, str]]
    device_peak_bytes: int
    # Seconds per phase (load, build, inputs, honest, float64, calibrate, inputs_to_host,
    # op_log_and_flops; summed over the sets) and in all ("oracle").
    phase_s: NotRequired[dict[str, float]]


OracleRequest = PrepareRequest
Request = WorkerRequest | OracleRequest | StartRequest | ExitRequest
