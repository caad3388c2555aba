"""The embedded model: converted from the packaged GGUF once, quietly."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_the_first_conversion_of_the_packaged_model_draws_no_progress_bar(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    from kz_stream.llm import smollm2_dir

    path = smollm2_dir(tmp_path)  # an empty cache: the GGUF is converted here
    assert (path / "config.json").is_file()
    # transformers' own bars answer to its switch (kz_stream.logging turns them off);
    # the GGUF conversion's does not.
    assert "de-quantizing GGUF tensors" not in capfd.readouterr().err
