"""``kz warmstart train``: supervised fine-tuning on a warm-start set with TRL's SFTTrainer.

The rows are TRL's conversational prompt-completion form (``kz_stream.warmstart.data``),
so the prompt goes through the model's chat template exactly as the generators render it
(``kz_stream.llm.encode_prompt``) and the loss covers the completion only. LoRA by
default, with the learner's own LoRA shape (so CA-GRPO goes on from the adapter); a full
fine-tune is an option. The adapter folder gets a card (``warmstart.json``) with the data
counts, the command, the commit and the training metrics.
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CARD", "SFTOptions", "train_sft"]

CARD = "warmstart.json"


@dataclass(frozen=True)
class SFTOptions:
    data: Path  # a coder_sft.jsonl or proposer_sft.jsonl
    out: Path
    role: str = "coder"
    base_model: str | None = None  # a model folder; None: the embedded SmolLM2
    full_finetune: bool = False
    epochs: float = 3.0
    learning_rate: float = 2e-4
    batch_size: int = 8
    grad_accum: int = 1
    max_length: int = 4096
    lora_r: int = 16
    lora_alpha: int = 32
    seed: int = 0
    device: str | None = None  # None: cuda when there is one
    limit: int | None = None  # first N rows only
    command: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def train_sft(options: SFTOptions) -> dict[str, Any]:
    """Trains and saves the adapter (or model) under ``options.out``; returns the card."""
    import torch
    from datasets import Dataset
    from trl.trainer.sft_config import SFTConfig
    from trl.trainer.sft_trainer import SFTTrainer

    from kz_stream.llm import smollm2_dir
    from kz_stream.rl.trainer import LearnerConfig, lora_config

    rows = [json.loads(line) for line in options.data.read_text().splitlines() if line.strip()]
    if options.limit is not None:
        rows = rows[: options.limit]
    if not rows:
        raise ValueError(f"{options.data}: no training rows")
    dataset = Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]}
                                 for r in rows])
    base = options.base_model or str(smollm2_dir())
    cuda = torch.cuda.is_available() if options.device is None else options.device == "cuda"
    peft_config = None if options.full_finetune else lora_config(
        LearnerConfig(lora_r=options.lora_r, lora_alpha=options.lora_alpha))
    config = SFTConfig(
        output_dir=str(options.out / "trainer"),
        num_train_epochs=options.epochs,
        learning_rate=options.learning_rate,
        per_device_train_batch_size=options.batch_size,
        gradient_accumulation_steps=options.grad_accum,
        max_length=options.max_length,
        completion_only_loss=True,
        bf16=cuda,
        use_cpu=not cuda,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,  # under 1: a share of the steps
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        seed=options.seed,
        model_init_kwargs={"dtype": torch.float32},
    )
    trainer = SFTTrainer(model=base, args=config, train_dataset=dataset,
                         peft_config=peft_config)
    started = time.monotonic()
    result = trainer.train()
    seconds = time.monotonic() - started
    options.out.mkdir(parents=True, exist_ok=True)
    model: Any = trainer.model
    if options.full_finetune:
        model.save_pretrained(str(options.out))
    else:  # no Hub lookup of the base (see rl.trainer's _write_policy)
        model.save_pretrained(str(options.out), save_embedding_layers=False)
    shutil.rmtree(options.out / "trainer", ignore_errors=True)
    (options.out / "README.md").unlink(missing_ok=True)  # peft's empty model-card template
    if options.full_finetune:
        tokenizer: Any = trainer.processing_class
        tokenizer.save_pretrained(str(options.out))
    else:
        _store_bf16(options.out / "adapter_model.safetensors")
        config_path = options.out / "adapter_config.json"
        adapter_config = json.loads(config_path.read_text())
        # The base is found by the loader, not by this path (a cache folder of the training host).
        adapter_config["base_model_name_or_path"] = Path(
            adapter_config.get("base_model_name_or_path") or "").name
        config_path.write_text(json.dumps(adapter_config, indent=2) + "\n")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    card = {
        "role": options.role,
        "kind": "full" if options.full_finetune else "lora",
        "base_model": "smollm2-135m-instruct" if options.base_model is None else base,
        "data": {"file": options.data.name, "rows": len(rows), **options.extra},
        "options": {k: (str(v) if isinstance(v, Path) else v)
                    for k, v in asdict(options).items() if k not in ("extra", "command")},
        "command": options.command,
        "commit": _commit(),
        "machine": f"{platform.node()} ({torch.cuda.get_device_name() if cuda else 'cpu'})",
        "date": time.strftime("%Y-%m-%d"),
        "stored_as": None if options.full_finetune else (
            "bfloat16 (trained in float32 under bf16 autocast; cast to halve the package)"),
        "metrics": {"train_loss": result.training_loss, "first_loss": losses[0] if losses else None,
                    "last_loss": losses[-1] if losses else None,
                    "steps": trainer.state.global_step, "seconds": round(seconds, 1)},
    }
    (options.out / CARD).write_text(json.dumps(card, indent=2) + "\n")
    return card


def _store_bf16(path: Path) -> None:
    """Rewrites a LoRA adapter's float32 weights as bfloat16 (half the bytes; peft loads it)."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v
               for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
