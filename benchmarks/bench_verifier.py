"""Verifier benchmark, for one H200 machine in one run.

(a) A/A: each of >= 20 reference modules timed against a copy of itself through the full
    interleaved timing path; p90 of |speedup - 1| (target <= 2%).
(b) Verified candidates per GPU-minute at full checks: already-compiled candidates
    (compile excluded), and fresh CUDA sources whose builds overlap the GPU stage on the
    CPU (compile included). Target >= 10 per GPU-minute.
(c) CUDA build throughput with 16 compilers (builds/min, target >= 30) against plain
    ``load_inline`` builds, 16 in parallel processes.
(d) The same candidates through a plain single-process check loop (KernelBench-style:
    5 random inputs, allclose, 100 timed trials) as the baseline ratio for (b).

Run: ``python -m benchmarks.bench_verifier [--quick] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kz_stream.testing.corpus.cuda_honest import CUDA_HONEST  # noqa: E402
from kz_stream.testing.corpus.problems import PROBLEMS  # noqa: E402
from kz_stream.testing.corpus.triton_honest import TRITON_HONEST  # noqa: E402

HEADER = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n"


def _module(expr: str, inputs: str, init: str = "[]", params: str = "") -> str:
    init_body = f"\n    def __init__(self{', ' + params if params else ''}):\n" \
                f"        super().__init__()\n" + "".join(
                    f"        self.{p.strip()} = {p.strip()}\n" for p in params.split(",")
                    if p.strip()) if params else ""
    return (HEADER + f"class Model(nn.Module):{init_body}\n    def forward(self, *xs):\n"
            f"        return {expr}\n\n\ndef get_inputs():\n    return {inputs}\n\n\n"
            f"def get_init_inputs():\n    return {init}\n")


def aa_modules() -> dict[str, str]:
    """>= 20 reference modules of assorted kinds and sizes."""
    big = "[torch.randn(4096, 4096)]"
    mid = "[torch.randn(2048, 2048)]"
    mods = dict(PROBLEMS)
    mods.update({
        "tanh": _module("torch.tanh(xs[0])", big),
        "sigmoid": _module("torch.sigmoid(xs[0])", big),
        "exp": _module("torch.exp(xs[0])", mid),
        "add": _module("xs[0] + xs[1]", "[torch.randn(4096, 4096), torch.randn(4096, 4096)]"),
        "mul_scalar": _module("xs[0] * 3.0", big),
        "mean_dim": _module("xs[0].mean(dim=0)", "[torch.randn(8192, 1024)]"),
        "max_dim": _module("xs[0].amax(dim=1)", "[torch.randn(8192, 1024)]"),
        "log_softmax": _module("F.log_softmax(xs[0], dim=1)", "[torch.randn(4096, 1024)]"),
        "bmm": _module("torch.bmm(xs[0], xs[1])",
                       "[torch.randn(16, 256, 512), torch.randn(16, 512, 256)]"),
        "small_matmul": _module("xs[0] @ xs[1]", "[torch.randn(256, 256), torch.randn(256, 256)]"),
        "conv2d": _module("F.conv2d(xs[0], xs[1], padding=1)",
                          "[torch.randn(16, 32, 64, 64), torch.randn(32, 32, 3, 3)]"),
        "cumsum": _module("torch.cumsum(xs[0], dim=1)", "[torch.randn(1024, 4096)]"),
        "tiny_relu": _module("torch.relu(xs[0])", "[torch.randn(1024)]"),
        "silu_mul": _module("F.silu(xs[0]) * xs[1]",
                            "[torch.randn(4096, 2048), torch.randn(4096, 2048)]"),
    })
    return mods


def as_candidate(reference: str) -> str:
    """The reference itself, renamed to ModelNew (an A/A candidate)."""
    return reference.replace("class Model(", "class ModelNew(")


def _vary_python(src: str, i: int) -> str:
    return f"# candidate variant {i}\n{src}"


def _vary_cuda(src: str, i: int) -> str:
    """A new CUDA source (so a new build) computing the same function."""
    return src.replace("__global__", f"/* variant {i} */ __global__", 1)


def flush_config(flush: str) -> dict[str, Any]:
    """VerifierConfig fields for ``--flush MODE[:FACTOR]`` (empty: the defaults)."""
    if not flush:
        return {}
    mode, _, factor = flush.partition(":")
    return {"l2_flush": mode, "l2_flush_factor": int(factor or 2)}


# ---- (a) A/A ------------------------------------------------------------------------------


async def bench_aa(quick: bool, save: Any = None, flush: str = "") -> dict[str, Any]:
    from kz_stream.verify import Candidate, Problem, Verifier, VerifierConfig

    mods = aa_modules()
    mods = dict(list(mods.items())[: 4 if quick else 20])
    cfg = VerifierConfig(static_scan=False, launch_checks=False, **flush_config(flush))
    out: dict[str, Any] = {}
    async with Verifier(cfg) as v:
        for name, src in mods.items():
            verdict = await v.verify(Problem(src), Candidate(as_candidate(src), "triton"))
            t = verdict.details.get("timing", {})
            out[name] = {"status": verdict.status.value, "speedup": verdict.speedup,
                         "ci": verdict.speedup_ci, "ref_ms": t.get("reference_ms"),
                         "samples": t.get("samples"), "reason": verdict.reason,
                         "timing": t}
            print(f"A/A {name}: {verdict.status.value} {verdict.speedup} {verdict.speedup_ci} "
                  f"{t.get('reference_ms')} ms {verdict.reason or ''}", flush=True)
            if save is not None:
                save({"aa": out})  # a run cut short keeps these
    return out


# ---- (b) throughput -----------------------------------------------------------------------


def _honest_pairs() -> list[tuple[str, str, str]]:
    """Honest candidates grouped by problem, as a Coder's group of samples arrives."""
    pairs = [(n, "triton", s) for n, s in TRITON_HONEST.items()]
    pairs += [(n, "cuda", s) for n, s in CUDA_HONEST.items()]
    return sorted(pairs, key=lambda p: p[0])


async def _timed_pass(v: Any, jobs: list[tuple[str, str, str]], label: str) -> dict[str, Any]:
    """Verifies ``jobs`` (problem, backend, source) concurrently, as a batch arrives."""
    from kz_stream.verify import Candidate, Problem

    t0 = time.monotonic()
    done = await asyncio.gather(*(v.verify(Problem(PROBLEMS[n]), Candidate(s, b))
                                  for n, b, s in jobs))
    wall = time.monotonic() - t0
    print(f"throughput ({label}): {60 * len(jobs) / wall:.1f}/min", flush=True)
    # Where each candidate's time went (waits for a slot and for the timing lock, worker
    # requests by kind), to see what bounds the rate.
    where = [{k: d.details.get(k) for k in ("seconds", "prepare_s", "gpu_wait_s",
                                            "worker_wait_s", "worker_start_s",
                                            "timing_wait_s", "timing_s", "stage_s")}
             for d in done]
    for (n, b, _), d, w in zip(jobs, done, where, strict=True):
        print(f"  {n}/{b}: {d.status.value} {d.check or ''} {w}", flush=True)
    return {"n": len(jobs), "wall_s": wall, "per_min": 60 * len(jobs) / wall,
            "statuses": [d.status.value for d in done],
            "reasons": [d.reason for d in done],
            "speedups": [d.speedup for d in done],
            "per_candidate_s": [d.details.get("seconds") for d in done],
            "where": where}


async def bench_throughput(quick: bool, cache_dir: str, save: Any, flush: str = ""
                           ) -> dict[str, Any]:
    from kz_stream.verify import Verifier, VerifierConfig

    pairs = _honest_pairs()
    if quick:
        pairs = pairs[:3] + pairs[-1:]
    res: dict[str, Any] = {}
    async with Verifier(VerifierConfig(cache_dir=cache_dir, **flush_config(flush))) as v:
        # Compile included: fresh CUDA sources whose builds overlap the GPU stage of the
        # Triton candidates, and problems prepared on first use.
        res["included"] = await _timed_pass(v, pairs, "compile included")
        save({"throughput": res})  # a run cut short keeps this pass
        # Compile excluded: new candidates (new Python text), kernels already built; two of
        # each, so that start-up and drain are a smaller part of the pass.
        jobs = [(n, b, _vary_python(s, i)) for i in (1, 2) for n, b, s in pairs]
        res["excluded"] = await _timed_pass(v, jobs, "compile excluded")
    return res


# ---- (c) builds ---------------------------------------------------------------------------


def _build_calls(n: int, salt: int) -> list[Any]:
    from kz_stream.verify._extract import extract_inline_calls

    base = [extract_inline_calls(s)[0] for s in CUDA_HONEST.values()]  # type: ignore[index]
    calls = []
    for i in range(n):
        c = base[i % len(base)]
        src = _vary_cuda(c.cuda_sources[0], salt * 1000 + i)
        calls.append(type(c)(name=f"{c.name}_{salt}_{i}", cpp_sources=c.cpp_sources,
                             cuda_sources=(src,), functions=c.functions))
    return calls


def _baseline_build(args: tuple[Any, str]) -> float:
    """Builds one call with torch's own ``load_inline`` (the baseline); returns seconds.
    Runs in the calling process."""
    import torch.utils.cpp_extension as cpp_ext

    call, build_dir = args
    started = time.monotonic()
    cpp_ext.load_inline(
        name=call.name, cpp_sources=list(call.cpp_sources), cuda_sources=list(call.cuda_sources),
        functions=list(call.functions) or None, extra_cflags=list(call.extra_cflags),
        extra_cuda_cflags=list(call.extra_cuda_cflags), extra_ldflags=list(call.extra_ldflags),
        build_directory=build_dir, verbose=False,
    )
    return time.monotonic() - started


def bench_builds(quick: bool) -> dict[str, Any]:
    from kz_stream.verify._build import Builder

    jobs = len(os.sched_getaffinity(0))  # run under `taskset -c 0-15` on a larger host
    n_fast = 16 if quick else 32
    n_base = 4 if quick else 16
    calls = _build_calls(n_fast, 1)

    async def ours() -> tuple[float, list[Any]]:
        b = Builder(tempfile.mkdtemp(prefix="kzb-bench-"), jobs=jobs)
        t0 = time.monotonic()
        results = await asyncio.gather(*(b.build(c) for c in calls))
        return time.monotonic() - t0, results

    wall, results = asyncio.run(ours())
    layouts: dict[str, int] = {}
    for r in results:
        layouts[str(r.layout)] = layouts.get(str(r.layout), 0) + 1
    ok = sum(r.ok for r in results)
    print(f"builds: {ok}/{len(calls)} in {wall:.1f}s = {60 * ok / wall:.1f}/min {layouts}",
          flush=True)
    base_calls = _build_calls(n_base, 2)
    dirs = [tempfile.mkdtemp(prefix="kzb-base-") for _ in base_calls]
    t0 = time.monotonic()
    with mp.get_context("spawn").Pool(min(jobs, n_base)) as pool:
        secs = pool.map(_baseline_build, list(zip(base_calls, dirs, strict=True)))
    base_wall = time.monotonic() - t0
    print(f"baseline load_inline: {n_base} in {base_wall:.1f}s = {60 * n_base / base_wall:.1f}"
          f"/min (each {statistics.median(secs):.1f}s)", flush=True)
    return {"ours": {"n": len(calls), "ok": ok, "wall_s": wall, "per_min": 60 * ok / wall,
                     "layouts": layouts,
                     "median_build_s": statistics.median(r.seconds for r in results)},
            "baseline": {"n": n_base, "wall_s": base_wall, "per_min": 60 * n_base / base_wall,
                         "median_build_s": statistics.median(secs)}}


# ---- (d) plain loop -------------------------------------------------------------------------


def _plain_check(ref_src: str, cand_src: str, build_dir: str) -> dict[str, Any]:
    """KernelBench-style: one process, reference and candidate side by side, 5 random
    inputs checked with allclose(1e-2), 100 timed trials of each with CUDA events."""
    import importlib.util

    import torch

    def load(src: str, name: str) -> Any:
        path = os.path.join(build_dir, f"{name}.py")
        Path(path).write_text(src)
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    os.environ["TORCH_EXTENSIONS_DIR"] = build_dir
    t0 = time.monotonic()
    ref = load(ref_src, f"ref_{abs(hash(ref_src))}")
    cand = load(cand_src, f"cand_{abs(hash(cand_src))}")
    init = ref.get_init_inputs()
    torch.manual_seed(0)
    m = ref.Model(*init).cuda()
    torch.manual_seed(0)
    c = cand.ModelNew(*init).cuda()
    ok = True
    with torch.no_grad():
        for trial in range(5):
            torch.manual_seed(trial)
            xs = [x.cuda() if isinstance(x, torch.Tensor) else x for x in ref.get_inputs()]
            ok &= bool(torch.allclose(m(*xs), c(*xs), atol=1e-2, rtol=1e-2))
        times = {}
        for label, fn in (("ref", m), ("cand", c)):
            ev = []
            for _ in range(100):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn(*xs)
                e.record()
                torch.cuda.synchronize()
                ev.append(s.elapsed_time(e))
            times[label] = statistics.median(ev)
    return {"ok": ok, "speedup": times["ref"] / times["cand"], "s": time.monotonic() - t0}


def _plain_worker(args: tuple[list[tuple[str, str]], str]) -> list[dict[str, Any]]:
    pairs, d = args
    return [_plain_check(r, c, d) for r, c in pairs]


def bench_plain(quick: bool) -> dict[str, Any]:
    pairs = _honest_pairs()
    if quick:
        pairs = pairs[:3] + pairs[-1:]
    jobs = [(PROBLEMS[n], _vary_python(s, 200)) for n, _, s in pairs]
    d = tempfile.mkdtemp(prefix="kz-plain-")
    # Warm the CUDA builds in parallel (compile excluded, as in (b)).
    warm = [([(PROBLEMS[n], s)], d) for n, b, s in pairs if b == "cuda"]
    with mp.get_context("spawn").Pool(max(1, len(warm))) as pool:
        pool.map(_plain_worker, warm)
    with mp.get_context("spawn").Pool(1) as pool:
        t0 = time.monotonic()
        results = pool.map(_plain_worker, [(jobs, d)])[0]
        wall = time.monotonic() - t0
    print(f"plain loop: {len(jobs)} in {wall:.1f}s = {60 * len(jobs) / wall:.1f}/min", flush=True)
    return {"n": len(jobs), "wall_s": wall, "per_min": 60 * len(jobs) / wall,
            "ok": sum(r["ok"] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--parts", default="abcd")
    ap.add_argument("--note", default="", help="appended to the result's notes")
    ap.add_argument("--flush", default="", help="L2 flush MODE[:FACTOR] (default: config's)")
    ap.add_argument("--from-raw", nargs="*", default=None,
                    help="merge raw JSON files of earlier runs and write the result")
    args = ap.parse_args()
    out_dir = Path(args.out) if args.out else None
    raw: dict[str, Any] = {}
    if args.from_raw is not None:
        machine = None
        for f in args.from_raw:
            data = json.loads(Path(f).read_text())
            machine = data.pop("_machine", machine)
            raw.update(data)
        write(raw, args, None, machine)
        return
    cache = tempfile.mkdtemp(prefix="kz-bench-cache-")

    def save(partial: dict[str, Any] | None = None) -> None:
        # After each part (and pass), so a run cut short keeps what it measured.
        raw.update(partial or {})
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"verifier_partial_{args.parts}.json").write_text(
                json.dumps(raw, indent=1, default=str))

    if "c" in args.parts:
        raw["builds"] = bench_builds(args.quick)
        save()
    if "a" in args.parts:
        raw["aa"] = asyncio.run(bench_aa(args.quick, save, args.flush))
        save()
    if "b" in args.parts:
        raw["throughput"] = asyncio.run(bench_throughput(args.quick, cache, save, args.flush))
        save()
    if "d" in args.parts:
        raw["plain"] = bench_plain(args.quick)
    if out_dir is not None:
        from benchmarks._results import machine_description

        out_dir.mkdir(parents=True, exist_ok=True)
        raw["_machine"] = machine_description()
        (out_dir / f"verifier_raw_{args.parts}.json").write_text(
            json.dumps(raw, indent=1, default=str))
        raw.pop("_machine")
    raw["_command"] = "python -m benchmarks.bench_verifier " + " ".join(sys.argv[1:])
    write(raw, args, out_dir)


def write(raw: dict[str, Any], args: argparse.Namespace, out_dir: Path | None,
          machine: str | None = None) -> None:
    from benchmarks._results import metric, write_result

    m: dict[str, dict[str, Any]] = {}
    notes = []
    if "aa" in raw:
        devs = sorted(abs(r["speedup"] - 1) for r in raw["aa"].values()
                      if r["speedup"] is not None)
        if devs:
            p90 = devs[min(len(devs) - 1, round(0.9 * (len(devs) - 1)))]
            variant = f"; {raw['_aa_loop']}" if raw.get("_aa_loop") else ""
            m["aa_p90_abs_speedup_minus_1"] = metric(p90, f"fraction (target <= 0.02{variant})")
            m["aa_median_abs_speedup_minus_1"] = metric(statistics.median(devs), "fraction")
            m["aa_modules"] = metric(float(len(devs)), "modules")
    if "throughput" in raw:
        base = raw.get("plain", {}).get("per_min")
        t = raw["throughput"]
        for part in ("excluded", "included"):  # a run cut short may hold one only
            if part in t:
                m[f"verified_per_gpu_min_compile_{part}"] = metric(
                    t[part]["per_min"], "candidates/GPU-min (target >= 10)", base)
    if "plain" in raw:
        m["plain_loop_per_min"] = metric(raw["plain"]["per_min"], "candidates/min")
    if "builds" in raw:
        b = raw["builds"]
        m["cuda_builds_per_min"] = metric(b["ours"]["per_min"], "builds/min (target >= 30)",
                                          b["baseline"]["per_min"])
        m["cuda_build_median_s"] = metric(b["ours"]["median_build_s"], "s",
                                          b["baseline"]["median_build_s"])
        notes.append(f"build layouts: {b['ours']['layouts']}")
    notes.append("baselines: (b) vs (d) the plain single-process loop; (c) vs plain "
                 "load_inline builds in parallel processes")
    if args.note:
        notes.append(args.note)
    cmd = raw.pop("_command", None) or "python -m benchmarks.bench_verifier " + " ".join(
        sys.argv[1:])
    write_result("verifier", cmd, m, notes="; ".join(notes), out_dir=out_dir, machine=machine)


if __name__ == "__main__":
    main()
