"""Decode speed of the loop's Coder calls: the warm-start LoRA unmerged against folded.

    python -m benchmarks.bench_loop_decode [--out raw.json]   # on the GPU host
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


def main() -> None:
    from benchmarks._results import machine_description

    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, default=Path("loop_decode_raw.json"))
    args = parser.parse_args()
    results = asyncio.run(_measure(args.max_tokens))
    args.out.write_text(json.dumps({"variants": results, "max_tokens": args.max_tokens,
                                    "_machine": machine_description()}, indent=1))


def write(raw: dict[str, Any]) -> None:
    """Writes the result files from a raw run (on the machine that keeps the repo)."""
    from benchmarks._results import metric, write_result

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
