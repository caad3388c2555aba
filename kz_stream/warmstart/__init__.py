"""Warm start: modules synthesized from the API catalog, a Triton teacher for them, SFT on
its kernels, and the adapters that ship with the package (``kz_stream/data/warmstart``)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kz_stream.config import Settings
    from kz_stream.rl import Role

__all__ = ["packaged_adapter", "warm_adapter"]


def packaged_adapter(role: Role) -> Path | None:
    """The shipped warm-start LoRA adapter of a role, or None when none ships."""
    folder = Path(str(files("kz_stream"))) / "data" / "warmstart" / role
    return folder if (folder / "adapter_config.json").exists() else None


def warm_adapter(settings: Settings, role: Role) -> Path | None:
    """The adapter a role's generator and learner start from: the packaged one when
    ``warm_start`` is on and both run the embedded SmolLM2 (the adapters' base) with LoRA."""
    llm = settings.coder.llm if role == "coder" else settings.proposer.llm
    if (not settings.warm_start or llm.kind != "transformers" or llm.model is not None
            or settings.learner.model or settings.learner.full_finetune):
        return None
    return packaged_adapter(role)
