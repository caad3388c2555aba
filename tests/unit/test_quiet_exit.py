"""The first run's screen: no third-party noise that does not concern the user."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "default", "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300, env={**os.environ},
    )


def test_no_nanobind_leak_report_after_services_ran_with_triton_loaded() -> None:
    # run_services freezes start-up objects for the collector's sake; left frozen, they
    # were never freed and Triton's nanobind bindings reported them as leaks at exit.
    out = run_python("""
        import asyncio
        import triton.language  # noqa: F401  (its bindings hold objects in cycles)
        from kz_stream.config import Settings
        from kz_stream.runtime import Service, ServiceContext, run_services

        class Once(Service):
            name = "once"
            async def run(self) -> None:
                pass

        ctx = ServiceContext(settings=Settings(), store=None, bus=None)
        asyncio.run(run_services([Once(ctx)], install_signal_handlers=False))
    """)
    assert out.returncode == 0, out.stderr
    assert "nanobind" not in out.stderr


@pytest.mark.slow
def test_importing_the_trainer_does_not_warn_about_trls_vllm_range() -> None:
    out = run_python("import kz_stream.rl.trainer")
    assert out.returncode == 0, out.stderr
    assert "TRL currently supports vLLM versions" not in out.stderr


@pytest.mark.slow
def test_a_services_screen_has_no_vllm_triton_line_or_weight_loading_bars() -> None:
    # What `kz run` does before its first table: logging configured, then TRL (and through
    # it vLLM) imported and the embedded model loaded.
    out = run_python("""
        import logging
        from kz_stream.logging import configure_logging

        configure_logging("WARNING", json=False)
        import kz_stream.rl.trainer  # noqa: F401  (TRL imports vLLM)
        from transformers import AutoModelForCausalLM
        from kz_stream.llm import smollm2_dir

        AutoModelForCausalLM.from_pretrained(str(smollm2_dir()))
        logging.getLogger("vllm.triton_utils.importing").warning("another vLLM warning")
    """)
    assert out.returncode == 0, out.stderr
    assert "Disabling Triton" not in out.stderr
    assert "Loading weights" not in out.stderr
    assert "another vLLM warning" in out.stderr  # the filter is for that one line only
