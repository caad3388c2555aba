"""Decode speed of SmolLM2-135M under transformers on a GPU: the KV cache and the host read.

    python -m benchmarks.bench_decode [--prompt FILE] [--out raw.json]   # on the GPU host
    python -m benchmarks.bench_decode --from-raw raw.json                 # writes the results

One bfloat16 model, one prompt of 1,147 tokens (a KernelBench problem's source, repeated),
``model.generate`` with sampling at temperature 1 and every row forced to run its full
length. Each variant's milliseconds per decode step:

- ``dynamic + host read``: transformers' default cache, with a stopping criterion that
  reads the rows' last tokens on the host every step, as ``TransformersBackend`` did (the
  baseline);
- ``dynamic``: the same without the read (the backend now reads nothing per step unless
  stop strings are asked for);
- ``static + host read``: ``cache_implementation="static"``, no compile;
- ``compiled + host read``: static, the decode step under ``torch.compile`` (transformers'
  default ``CompileConfig``: CUDA graphs); its first call includes the compilation, a
  second call of the same shape does not. Then the same at 640 rows and 1,024 steps.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

_PROMPT_TOKENS = 1147
# (name, rows, steps, host read each step, GenerationConfig extras)
_VARIANTS: list[tuple[str, int, int, bool, dict[str, Any]]] = [
    ("dynamic + host read", 320, 512, True, {}),
    ("dynamic", 320, 512, False, {}),
    ("static + host read", 320, 512, True,
     {"cache_implementation": "static", "disable_compile": True}),
    ("compiled + host read, first call", 320, 512, True, {"cache_implementation": "static"}),
    ("compiled + host read", 320, 512, True, {"cache_implementation": "static"}),
    ("compiled + host read, first call", 640, 1024, True, {"cache_implementation": "static"}),
    ("compiled + host read", 640, 1024, True, {"cache_implementation": "static"}),
]


def main() -> None:
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        StoppingCriteria,
        StoppingCriteriaList,
    )

    from benchmarks._results import machine_description
    from kz_stream.llm import smollm2_dir

    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", type=Path, required=True,
                        help="A text file (e.g. KernelBench level1/1_Square_matrix_...py).")
    parser.add_argument("--out", type=Path, default=Path("decode_raw.json"))
    args = parser.parse_args()

    path = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    ids = tokenizer(args.prompt.read_text() * 6)["input_ids"][:_PROMPT_TOKENS]

    class HostRead(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            input_ids[:, -1].tolist()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    results = []
    for name, rows, steps, read, extra in _VARIANTS:
        x = torch.tensor([ids] * rows, device="cuda")
        config = GenerationConfig(max_new_tokens=steps, min_new_tokens=steps, do_sample=True,
                                  temperature=1.0, top_k=0, top_p=1.0,
                                  pad_token_id=tokenizer.eos_token_id, **extra)
        torch.cuda.synchronize()
        t = time.monotonic()
        with torch.inference_mode():
            model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                           generation_config=config,
                           stopping_criteria=StoppingCriteriaList([HostRead()] if read else []))
        torch.cuda.synchronize()
        s = time.monotonic() - t
        results.append({"name": name, "rows": rows, "steps": steps, "s": round(s, 2),
                        "ms_per_step": round(1000 * s / steps, 1),
                        "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1)})
        print(json.dumps(results[-1]), flush=True)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    args.out.write_text(json.dumps({"variants": results, "_machine": machine_description()},
                                   indent=1))


def write(raw: dict[str, Any]) -> None:
    """Writes the result files from a raw run (on the machine that keeps the repo)."""
    from benchmarks._results import metric, write_result

    [base] = [v for v in raw["variants"] if v["name"] == "dynamic + host read"]
    m: dict[str, dict[str, Any]] = {}
    for v in raw["variants"]:
        shape = f"{v['rows']} rows x {v['steps']} steps"
        comparable = v is not base and (v["rows"], v["steps"]) == (base["rows"], base["steps"])
        m[f"{v['name']}, {shape}"] = metric(v["ms_per_step"], "ms per decode step",
                                            base["ms_per_step"] if comparable else None)
        m[f"{v['name']}, {shape}: peak memory"] = metric(v["peak_gb"], "GB")
    write_result("decode", "python -m benchmarks.bench_decode --prompt "
                 "KernelBench/level1/1_Square_matrix_multiplication_.py", m,
                 notes="SmolLM2-135M bfloat16, a 1,147-token prompt, model.generate alone on "
                       "the GPU (no verifier beside it); baseline: the dynamic cache with a "
                       "host read each step, 320 rows x 512 steps. "
                       + raw.get("_note", ""),
                 machine=raw.get("_machine"))


if __name__ == "__main__":
    from benchmarks._results import main_or_from_raw

    main_or_from_raw(main, write)
