"""The compiled baseline on the CPU: the timing protocol both timings share (``interleave``),
the measurement around a compiled reference worker (``measure_compiled``, with stand-in
workers), its cache per lane and problem, the details a verdict gets, and the worker's
``_model`` building a ``torch.compile`` module for real. The GPU path end to end is in
``test_gpu.py`` (``test_compiled_baseline_*``)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kz_stream.verify import VerifierConfig
from kz_stream.verify._checks import (
    Side,
    baseline_details,
    interleave,
    measure_compiled,
)
from kz_stream.verify._ipc import ChildDied, ChildTimeout
from kz_stream.verify._messages import TimeReply, TimeRequest
from kz_stream.verify._pool import CompiledBaseline, Lane, RefTimer
from kz_stream.verify._prepared import Prepared

ROOT = Path(__file__).resolve().parents[2]


def reply(ms: float, ask: TimeRequest, jitter: float = 0.0) -> TimeReply:
    n = ask["calls"]
    event = [ms * (1 + jitter * ((i % 3) - 1)) for i in range(n)]
    return {"ok": True, "event_ms": event, "host_ms": [e + 0.01 for e in event],
            "issue_ms": [0.02] * n, "outputs": {k: [k] for k in ask["keep"]}}


def test_interleave_alternates_sides_on_the_same_calls() -> None:
    seen: list[tuple[str, int, int, tuple[int, ...]]] = []

    def side(name: str, ms: float) -> Side:
        async def round_(ask: TimeRequest) -> TimeReply:
            seen.append((name, ask["start"], ask["calls"], tuple(ask["keep"])))
            return reply(ms, ask, jitter=0.001)
        return Side(round_)

    cfg = VerifierConfig(min_rounds=4, max_rounds=16, round_ms=10.0, target_ci=0.01)
    base, other = side("base", 2.0), side("other", 0.5)
    res = asyncio.run(interleave(cfg, 7, base, other, pad_ms=0.1))
    assert res.speedup == pytest.approx(4.0, rel=1e-3)
    assert res.ci[0] <= res.speedup <= res.ci[1] and res.ci[1] - res.ci[0] < 0.04
    assert res.rounds == 4  # the interval was tight at the fewest rounds allowed
    # Base first in even rounds, the other side first in odd ones; both on the same calls.
    assert [name for name, *_ in seen] == ["base", "other", "other", "base"] * 2
    for a, b in zip(seen[::2], seen[1::2], strict=True):
        assert a[1:] == b[1:]
        start, calls, keep = a[1:]
        assert len(keep) == 1 and start <= keep[0] < start + calls
    starts = [s for name, s, *_ in seen if name == "base"]
    calls = [c for name, _, c, _ in seen if name == "base"]
    assert starts == [sum(calls[:i]) for i in range(len(calls))]
    # Rounds sized to ~round_ms of the slower side (2 ms a call plus the pad).
    assert calls[0] == 3 and calls[1] == int(10.0 / 2.1)
    assert sorted(base.kept) == sorted(other.kept) and len(base.kept) == 4
    assert len(base.event_ms) == len(other.event_ms) == sum(calls)


# ---- measure_compiled with stand-in workers ------------------------------------------------


class FakeChild:
    """A worker that answers each request kind as told and records what it was sent."""

    def __init__(self, ms: float = 1.0, answers: dict[str, Callable[[Any], Any]] | None = None
                 ) -> None:
        self.ms = ms
        self.answers = answers or {}
        self.sent: list[tuple[dict[str, Any], float]] = []
        self.killed = False

    def call(self, msg: Any, timeout_s: float) -> Any:
        self.sent.append((dict(msg), timeout_s))
        answer = self.answers.get(msg["cmd"])
        if answer is not None:
            return answer(msg)
        if msg["cmd"] == "time":
            return reply(self.ms, msg)
        return {"ok": True}

    def kill(self) -> None:
        self.killed = True


def prepared() -> Prepared:
    return Prepared(
        key="problem-1", source="import torch\nclass Model(torch.nn.Module): ...\n", seed=11,
        sets=[], tolerances=[], specs=[{"shape": [4], "dtype": "float32"}], ref_ops=[],
        static_ops=frozenset(), flops=0, bytes=0, input_bytes=16, weight_seed=3,
        own_model_key="own", init_args=[4], notes=[], plan_notes=[], dropped=[],
        device_peak_bytes=0, host_bytes=0)


def lane_with(worker: FakeChild | BaseException, cfg: VerifierConfig) -> Lane:
    lane = Lane(cfg, None)

    async def take_worker() -> Any:
        if isinstance(worker, BaseException):
            raise worker
        return worker

    lane.take_worker = take_worker  # type: ignore[method-assign]
    return lane


def measure(worker: FakeChild | BaseException, cfg: VerifierConfig,
            eager: FakeChild | None = None) -> tuple[CompiledBaseline, Lane]:
    lane = lane_with(worker, cfg)
    ref = RefTimer(eager or FakeChild(ms=3.0), pad_cycles=1234, pad_ms=0.05)  # type: ignore[arg-type]
    result = asyncio.run(measure_compiled(cfg, lane, prepared(), ref, 2, 99))
    return result, lane


def test_the_compiled_reference_is_built_compiled_and_timed_like_a_candidate() -> None:
    cfg = VerifierConfig(compiled_baseline=True, compile_mode="max-autotune",
                         compile_timeout_s=77.0, load_timeout_s=33.0)
    compiled = FakeChild(ms=1.5)
    b, lane = measure(compiled, cfg)
    assert b.error is None
    assert b.speedup == pytest.approx(2.0) and b.ci == pytest.approx((2.0, 2.0))
    assert (b.eager_ms, b.compiled_ms) == (pytest.approx(3.0), pytest.approx(1.5))
    cmds = [m["cmd"] for m, _ in compiled.sent]
    assert cmds[:3] == ["load", "model", "time_setup"] and set(cmds[3:]) == {"time"}
    (load, t_load), (model, t_model), (setup, t_setup) = compiled.sent[:3]
    assert load["source"].endswith("\n\nModelNew = Model\n") and load["builds"] == []
    assert model["compile"] is True and model["compile_mode"] == "max-autotune"
    assert model["weight_seed"] == 3 and model["init_args"] == [4]
    assert (t_load, t_model, t_setup) == (33.0, 33.0, 77.0)  # it compiles in the warm-up
    assert setup["seed"] == 99 and setup["sets"] == 2 and not setup.get("measure_pad")
    # Its timed calls get the eager reference's pad, as a candidate's do.
    assert all(m["pad_cycles"] == 1234 for m, _ in compiled.sent[3:])
    assert compiled.killed and not lane.compiling
    assert b.info["mode"] == "max-autotune" and b.info["rounds"] >= cfg.min_rounds
    assert b.info["samples"][0] == b.info["samples"][1] > 0


@pytest.mark.parametrize("case", ["unknown mode", "compile timeout", "crash", "no worker",
                                  "eager side fails"])
def test_a_failed_compiled_baseline_is_a_short_message_not_an_exception(case: str) -> None:
    cfg = VerifierConfig(compiled_baseline=True, compile_timeout_s=5.0)
    eager: FakeChild | None = None
    worker: FakeChild | BaseException
    if case == "unknown mode":
        worker = FakeChild(answers={"model": lambda m: {
            "ok": False, "error": "exception",
            "message": "Unrecognized mode=x,\n should be one of: default, ..." + "x" * 1000}})
        want = "construct: exception: Unrecognized mode=x, should be one of"
    elif case == "compile timeout":
        def slow(m: Any) -> Any:
            raise ChildTimeout("no answer within 5 s")
        worker = FakeChild(answers={"time_setup": slow})
        want = "compile: timed out (no answer within 5 s)"
    elif case == "crash":
        def died(m: Any) -> Any:
            raise ChildDied("child exited (code -11)")
        worker = FakeChild(answers={"time": died})
        want = "timing: child exited (code -11)"
    elif case == "no worker":
        worker = ChildDied("the verifier is closed")
        want = "worker start: the verifier is closed"
    else:
        worker = FakeChild()
        eager = FakeChild(answers={"time": lambda m: {"ok": False, "message": "boom"}})
        want = "timing: eager reference: boom"
    b, lane = measure(worker, cfg, eager)
    assert b.error is not None and b.error.startswith(want), b.error
    assert len(b.error) <= 300 and "\n" not in b.error
    assert b.speedup is None and not lane.compiling
    if isinstance(worker, FakeChild):
        assert worker.killed


def test_the_baseline_is_measured_once_per_problem_and_lane_failures_included() -> None:
    lane = Lane(VerifierConfig(), None)
    calls: list[str] = []

    def measure_as(result: CompiledBaseline) -> Callable[[], Any]:
        async def measure() -> CompiledBaseline:
            calls.append("measured")
            await asyncio.sleep(0.01)  # the others wait meanwhile
            return result
        return measure

    async def go() -> list[CompiledBaseline]:
        ok = CompiledBaseline(speedup=1.5, ci=(1.4, 1.6), eager_ms=3.0, compiled_ms=2.0)
        failed = CompiledBaseline(error="compile: timed out")
        first = await asyncio.gather(*(lane.compiled_baseline(("p", 2), measure_as(ok))
                                       for _ in range(3)))
        again = await lane.compiled_baseline(("p", 2), measure_as(failed))
        bad = [await lane.compiled_baseline(("q", 2), measure_as(failed)) for _ in range(2)]
        return [*first, again, *bad]

    results = asyncio.run(go())
    assert calls == ["measured", "measured"]  # once for p, once for q
    assert all(r.speedup == 1.5 for r in results[:4])
    assert all(r.error == "compile: timed out" for r in results[4:])


def test_a_timed_verdict_gets_the_speedup_against_the_compiled_reference() -> None:
    details: dict[str, Any] = {"timing": {"candidate_ms": 0.5, "reference_ms": 1.0}}
    b = CompiledBaseline(speedup=1.25, ci=(1.2, 1.3), eager_ms=1.0, compiled_ms=0.8,
                         info={"mode": "default", "compile_s": 12.0})
    baseline_details(details, 2.0, b)
    assert details["timing"]["compiled_reference_ms"] == 0.8
    assert details["timing"]["candidate_ms"] == 0.5  # the candidate's own figures stay
    assert details["compile_speedup"] == 1.25 and details["compile_speedup_ci"] == [1.2, 1.3]
    assert details["speedup_vs_compile"] == pytest.approx(1.6)
    assert details["compiled_baseline"]["compile_s"] == 12.0
    assert "compiled_baseline_error" not in details

    failed: dict[str, Any] = {"timing": {"candidate_ms": 0.5}}
    baseline_details(failed, 2.0, CompiledBaseline(error="construct: exception: bad mode"))
    assert failed["compiled_baseline_error"] == "construct: exception: bad mode"
    assert "speedup_vs_compile" not in failed and "compile_speedup" not in failed
    assert "compiled_reference_ms" not in failed["timing"]


# ---- the worker's _model with the compile flag, for real ------------------------------------

_MODEL_CHECK = textwrap.dedent('''
    import json, os, time
    import torch
    from kz_stream.verify._harness import HANDLERS, State, _call

    out = {}
    source = """
    import torch

    class Model(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.lin = torch.nn.Linear(n, n)

        def forward(self, x):
            return torch.relu(self.lin(x)) * 2.0 + x.sum(dim=-1, keepdim=True)

    ModelNew = Model
    """
    state = State("cpu")
    HANDLERS["load"](state, {"cmd": "load", "source": source, "builds": []})
    torch.manual_seed(5)
    weights = {k: v.clone() for k, v in state.model_cls(16).state_dict().items()}
    base = {"cmd": "model", "init_args": [16], "weight_seed": 1, "state_dict": weights}
    eager = HANDLERS["model"](state, {**base, "key": "eager"})
    comp = HANDLERS["model"](state, {**base, "key": "compiled", "compile": True})
    out["replies"] = [eager, comp]
    out["type"] = type(state.models["compiled"]).__name__
    try:
        HANDLERS["model"](state, {**base, "key": "bad", "compile": True,
                                  "compile_mode": "no-such-mode"})
        out["bad_mode"] = None
    except Exception as e:
        out["bad_mode"] = f"{type(e).__name__}: {e}"
    x = torch.randn(8, 16)
    t = time.monotonic()
    try:
        got = _call(state, [x], "compiled")  # compiles
    except Exception as e:
        try:  # does torch.compile work here at all (a C++ compiler Inductor can use)?
            torch.compile(lambda t: t * 2 + 1)(torch.ones(3))
        except Exception:
            print("NO_COMPILE " + " ".join(f"{type(e).__name__}: {e}".split())[:300])
            raise SystemExit(0)
        raise
    out["compile_s"] = time.monotonic() - t
    want = _call(state, [x], "eager")
    out["max_abs_diff"] = float((got - want).abs().max())
    again = _call(state, [torch.randn(8, 16)], "compiled")  # the same shapes: no recompile
    out["shape"] = list(again.shape)
    out["env"] = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    import torch._inductor.config as c
    from torch._inductor import async_compile
    out["compile_threads"] = c.compile_threads
    # No pool of compile workers (subprocesses, which a worker's audit hook refuses) was
    # made, and no process of ours is left (the compiler's are done).
    out["pools"] = len(getattr(async_compile, "_pool_set", ()))
    def parent_of(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[1]
        except OSError:  # it ended between the listing and the read (seen once in CI)
            return None
    out["children"] = [p for p in os.listdir("/proc") if p.isdigit()
                       and parent_of(p) == str(os.getpid())]
    print("RESULT " + json.dumps(out))
''')


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "/opt/gcc/bin/g++"):
        if name and shutil.which(name):
            return name
    return None


@pytest.mark.slow
def test_the_model_request_with_the_compile_flag_builds_a_compiled_module(
        tmp_path: Path) -> None:
    """``_model`` with ``compile`` wraps the built module (weights loaded first) in
    ``torch.compile``; its output equals the eager module's, and Inductor was set to
    compile in process (``compile_threads`` 1: its pool of compile workers would start
    subprocesses, which a worker's audit hook refuses; on the CPU it makes no pool either
    way, so the setting is what is checked). Run in a fresh process, as a worker would, with
    the caches in its private folder. Not under the audit hook itself: Inductor's CPU
    backend starts programs of its own (a Python to probe vector instructions, openssl to
    hash headers) that a GPU worker's Inductor, which writes Triton kernels, does not."""
    if _compiler() is None:
        pytest.skip("Inductor's CPU backend needs a C++ compiler (g++), and none is here")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / ".inductor"),
           "TRITON_CACHE_DIR": str(tmp_path / ".triton"), "HOME": str(tmp_path),
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    if not os.environ.get("CC") and os.path.exists("/opt/gcc/bin/gcc"):
        env["CC"] = "/opt/gcc/bin/gcc"
    limit = 120
    try:
        done = subprocess.run([sys.executable, "-c", _MODEL_CHECK],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=limit)
    except subprocess.TimeoutExpired:
        pytest.skip(f"torch.compile on this CPU took longer than {limit} s (a loaded machine)")
    no_compile = [ln for ln in done.stdout.splitlines() if ln.startswith("NO_COMPILE ")]
    if no_compile:
        pytest.skip(f"torch.compile does not work on this CPU: {no_compile[0][11:]}")
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    eager, comp = out["replies"]
    assert eager["weights_loaded"] and comp["weights_loaded"]
    assert eager["param_count"] == comp["param_count"] == 16 * 16 + 16
    assert out["type"] == "OptimizedModule"
    assert out["max_abs_diff"] < 1e-4
    assert out["shape"] == [8, 16]
    assert out["bad_mode"] is not None and "no-such-mode" in out["bad_mode"]
    assert out["env"] == "1" and out["compile_threads"] == 1
    assert out["pools"] == 0 and out["children"] == []
    print(f"compile took {out['compile_s']:.1f} s")
