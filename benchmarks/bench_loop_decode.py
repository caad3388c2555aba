"""Decode speed of the loop's Coder calls: the warm-start LoRA unmerged against folded;
and (``--beside``) the folded Coder alone against beside the Proposer's decoding.

    python -m benchmarks.bench_loop_decode [--beside] [--out raw.json]  # on the GPU host
    python -m benchmarks.bench_loop_decode --from-raw raw.json  # writes the results

``TransformersBackend`` on one CUDA device with the shipped Coder warm start as policy
version 0, as ``kz run --device cuda`` builds it, sampling the Coder's prompt of a seed
module (temperature 1, up to ``--max-tokens``) in calls of 4, 16 and 64 rows (1, 4 and 16
modules of 4 samples). Two backends side by side, called in turn: peft's unmerged LoRA
(the baseline; every adapted layer adds its kernels to a launch-bound step) and the LoRA
folded into the weights (``merge_adapter``). Each variant's milliseconds per decode step
over its calls (a call's steps: its longest row), after one warm-up call each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

_ROWS = (4, 16, 64)
_CALLS = 2


async def _measure(max_tokens: int) -> list[dict[str, Any]]:
    import torch

    from kz_stream.llm import SamplingParams, TransformersBackend
    from kz_stream.modules import coder_messages
    from kz_stream.warmstart import packaged_adapter
    from producers.seeds import SEED_MODULES

    adapter = packaged_adapter("coder")
    assert adapter is not None, "the package ships no Coder warm start"
    backends = {
        name: TransformersBackend.smollm2(device="cuda", adapter=str(adapter),
                                          merge_adapter=merge, max_batch_size=max(_ROWS))
        for name, merge in (("unmerged LoRA", False), ("folded LoRA", True))
    }
    prompt = coder_messages(SEED_MODULES[2].source, "triton")  # matmul + relu
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0)
    results = []
    try:
        for b in backends.values():  # warm-up: CUDA context, kernels' first launches
            await b.generate([prompt], n=4, sampling=SamplingParams(max_tokens=16))
        for rows in _ROWS:
            timings: dict[str, list[tuple[float, int]]] = {name: [] for name in backends}
            for _ in range(_CALLS):
                for name, b in backends.items():
                    torch.cuda.synchronize()
                    t = time.monotonic()
                    [samples] = await b.generate([prompt], n=rows, sampling=sampling)
                    torch.cuda.synchronize()
                    steps = max(len(s.token_ids) for s in samples)
                    timings[name].append((time.monotonic() - t, steps))
            for name, calls in timings.items():
                seconds, steps = sum(c[0] for c in calls), sum(c[1] for c in calls)
                results.append({"name": name, "rows": rows, "steps": steps,
                                "s": round(seconds, 2),
                                "ms_per_step": round(1000 * seconds / max(steps, 1), 1)})
                print(json.dumps(results[-1]), flush=True)
    finally:
        for b in backends.values():
            await b.close()
    return results


_BESIDE_ROWS = 64


_DEVICE = "cuda"  # --device: a CPU dry run of the script's logic


def _sync() -> None:
    import torch

    if _DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


async def _proposer_backend() -> Any:
    from kz_stream.llm import TransformersBackend
    from kz_stream.warmstart import packaged_adapter

    adapter = packaged_adapter("proposer")
    return TransformersBackend.smollm2(device=_DEVICE, merge_adapter=True, max_batch_size=16,
                                       adapter=str(adapter) if adapter else None)


def _proposer_prompt() -> Any:
    from kz_stream.modules import proposer_messages

    return proposer_messages(["torch.matmul", "torch.softmax", "torch.nn.LayerNorm"])


async def _propose_forever() -> None:
    """The Proposer's calls (16 rows) back to back in a process of their own."""
    from kz_stream.llm import SamplingParams

    proposer = await _proposer_backend()
    sampling = SamplingParams(max_tokens=512, temperature=1.0)
    await proposer.generate([_proposer_prompt()], n=16, sampling=SamplingParams(max_tokens=8))
    print("ready", flush=True)
    while True:
        await proposer.generate([_proposer_prompt()], n=16, sampling=sampling)


async def _measure_beside(max_tokens: int, rows: int = _BESIDE_ROWS) -> list[dict[str, Any]]:
    """The folded Coder's 64-row calls alone, beside the Proposer decoding in this process
    (its own generation thread, as in ``kz run``), and beside it in another process."""
    import sys

    from kz_stream.llm import SamplingParams, TransformersBackend
    from kz_stream.modules import coder_messages
    from kz_stream.warmstart import packaged_adapter
    from producers.seeds import SEED_MODULES

    coder = TransformersBackend.smollm2(device=_DEVICE, adapter=str(packaged_adapter("coder")),
                                        merge_adapter=True, max_batch_size=rows)
    proposer = await _proposer_backend()
    prompt = coder_messages(SEED_MODULES[2].source, "triton")
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0)
    warm = SamplingParams(max_tokens=16)
    await coder.generate([prompt], n=4, sampling=warm)
    await proposer.generate([_proposer_prompt()], n=16, sampling=warm)
    results: list[dict[str, Any]] = []

    async def coder_calls(name: str) -> None:
        seconds = steps = 0.0
        for _ in range(_CALLS):
            _sync()
            t = time.monotonic()
            [samples] = await coder.generate([prompt], n=rows, sampling=sampling)
            _sync()
            seconds += time.monotonic() - t
            steps += max(len(x.token_ids) for x in samples)
        results.append({"name": name, "rows": rows, "steps": int(steps),
                        "s": round(seconds, 2),
                        "ms_per_step": round(1000 * seconds / max(steps, 1), 1)})
        print(json.dumps(results[-1]), flush=True)

    try:
        await coder_calls("Coder alone")
        running = True

        async def propose() -> None:
            while running:
                await proposer.generate([_proposer_prompt()], n=16,
                                        sampling=SamplingParams(max_tokens=512))

        task = asyncio.create_task(propose())
        await coder_calls("Coder beside the Proposer, one process")
        running = False
        await task
        await proposer.close()
        other = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.bench_loop_decode", "--propose-forever",
            "--device", _DEVICE,
            stdout=asyncio.subprocess.PIPE)
        try:
            assert other.stdout is not None
            assert (await other.stdout.readline()).strip() == b"ready"
            await coder_calls("Coder beside the Proposer, two processes")
        finally:
            other.kill()
            await other.wait()
    finally:
        await coder.close()
    return results


def main() -> None:
    from benchmarks._results import machine_description

    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("loop_decode_raw.json"))
    parser.add_argument("--beside", action="store_true",
                        help="The Coder alone against beside the Proposer (in this process, "
                             "in another).")
    parser.add_argument("--propose-forever", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=_BESIDE_ROWS)
    args = parser.parse_args()
    global _DEVICE
    _DEVICE = args.device
    if args.propose_forever:
        asyncio.run(_propose_forever())
        return
    if args.beside:
        beside = asyncio.run(_measure_beside(args.max_tokens, args.rows))
        args.out.write_text(json.dumps({"beside": beside, "max_tokens": args.max_tokens,
                                        "_machine": machine_description()}, indent=1))
        return
    results = asyncio.run(_measure(args.max_tokens))
    args.out.write_text(json.dumps({"variants": results, "max_tokens": args.max_tokens,
                                    "_machine": machine_description()}, indent=1))


def write(raw: dict[str, Any]) -> None:
    """Writes the result files from a raw run (on the machine that keeps the repo)."""
    from benchmarks._results import metric, write_result

    if "beside" in raw:
        alone = raw["beside"][0]["ms_per_step"]
        write_result(
            "loop_decode_beside", "python -m benchmarks.bench_loop_decode --beside",
            {f"{v['name']}, {v['rows']} rows": metric(
                v["ms_per_step"], "ms per decode step", None if i == 0 else alone)
             for i, v in enumerate(raw["beside"])},
            notes="The folded Coder (SmolLM2-135M bfloat16, shipped warm start) decoding "
                  f"calls of {raw['beside'][0]['rows']} rows, {_CALLS} calls of up to "
                  f"{raw['max_tokens']} tokens each: alone, then while the Proposer's "
                  "backend decodes 16-row calls back to back in the same process (each "
                  "backend has its own generation thread, as in `kz run`), then while it "
                  "does so in a process of its own; baseline: the Coder alone. "
                  + raw.get("_note", ""),
            machine=raw.get("_machine"))
        return

    base = {v["rows"]: v for v in raw["variants"] if v["name"] == "unmerged LoRA"}
    m: dict[str, dict[str, Any]] = {}
    for v in raw["variants"]:
        baseline = None if v["name"] == "unmerged LoRA" else base[v["rows"]]["ms_per_step"]
        m[f"{v['name']}, {v['rows']} rows"] = metric(v["ms_per_step"], "ms per decode step",
                                                     baseline)
    write_result("loop_decode", "python -m benchmarks.bench_loop_decode", m,
                 notes="SmolLM2-135M bfloat16 with the shipped Coder warm start, "
                       "TransformersBackend on the GPU alone (no verifier or second "
                       f"generator beside it), a seed module's Coder prompt, {_CALLS} calls "
                       f"per variant and size of up to {raw['max_tokens']} tokens; "
                       "baseline: peft's unmerged LoRA at the same rows. "
                       + raw.get("_note", ""),
                 machine=raw.get("_machine"))


if __name__ == "__main__":
    from benchmarks._results import main_or_from_raw

    main_or_from_raw(main, write)
