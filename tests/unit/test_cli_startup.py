"""``kz --help`` starts fast: the command line imports the heavy libraries only in the
commands that use them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kz_help_imports_no_heavy_library() -> None:
    # A fresh interpreter: this test process may have imported torch already.
    code = (
        "import runpy, sys\n"
        "sys.argv = ['kz', '--help']\n"
        "try:\n"
        "    runpy.run_module('kz_stream.cli', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        "heavy = [m for m in ('torch', 'vllm', 'transformers', 'datasets', 'producers',"
        " 'consumers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "Usage:" in done.stdout
