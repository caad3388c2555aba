"""Prompt templates: structure, the stated output contract, and correct worked examples."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest

from kz_stream.modules import (
    CODER_EXAMPLE_MODULE,
    CODER_EXAMPLES,
    PROPOSER_EXAMPLES,
    coder_messages,
    extract_code,
    prompt_text,
    proposer_messages,
)


def test_proposer_chat_shape() -> None:
    msgs = proposer_messages(["torch.nn.Conv2d", "torch.relu"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[-1]["content"].endswith("torch.nn.Conv2d, torch.relu.")
    for m in msgs[2:5:2]:  # the worked answers extract cleanly
        assert extract_code(m["content"], require="class Model") is not None
    assert [m["role"] for m in proposer_messages(["a", "b"], few_shot=False)] == ["system", "user"]


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_coder_chat_states_the_contract(backend: str) -> None:
    module = PROPOSER_EXAMPLES[0][1]
    msgs = coder_messages(module, backend)  # type: ignore[arg-type]
    system = msgs[0]["content"]
    for phrase in ("ModelNew", "same arguments as `Model.__init__`", "Model.forward", "same order"):
        assert phrase in system
    assert "1e-2" not in system  # the verifier's rule is far tighter than a fixed tolerance
    assert ("load_inline" in system) == (backend == "cuda")
    assert ("@triton.jit" in system) == (backend == "triton")
    assert module in msgs[-1]["content"]
    answer = extract_code(msgs[2]["content"], require="class ModelNew")
    assert answer is not None
    tree = ast.parse(answer)
    names = {n.name for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef)}
    assert "ModelNew" in names and "Model" not in names
    assert json.loads(prompt_text(msgs)) == msgs


def test_the_stated_correctness_rule_is_the_verifiers() -> None:
    """The prompt's numbers are the verifier's bounds (kz_stream/verify/_compare.py)."""
    pytest.importorskip("torch")
    from kz_stream.verify._compare import FLOOR, SAFETY

    system = coder_messages(CODER_EXAMPLE_MODULE, "triton")[0]["content"]
    flat = " ".join(system.split())
    assert f"at most {SAFETY:g} times `Model`'s own error" in flat
    assert f"never under {FLOOR:g} machine epsilons" in flat
    assert "float64" in flat and "TF32" in flat
    for input_set in ("sign-mixed", "heavy-tailed", "odd sizes", "small shapes", "run twice"):
        assert input_set in flat


def test_unknown_backend() -> None:
    with pytest.raises(ValueError):
        coder_messages("x", "opencl")  # type: ignore[arg-type]


def test_the_triton_example_is_correct_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    script = textwrap.dedent(
        """
        import sys, torch
        from kz_stream.modules import CODER_EXAMPLE_MODULE, CODER_EXAMPLES
        ref, new = {}, {}
        exec(CODER_EXAMPLE_MODULE, ref)
        exec(CODER_EXAMPLES["triton"], new)
        x = torch.randn(3, 1500)
        want = ref["Model"](*ref["get_init_inputs"]())(x)
        got = new["ModelNew"](*ref["get_init_inputs"]())(x)
        sys.exit(0 if torch.allclose(want, got) else 1)
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, timeout=120
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]


def test_the_cuda_example_has_the_kernel_and_wrapper() -> None:
    src = CODER_EXAMPLES["cuda"]
    assert "__global__" in src and "load_inline(" in src and 'functions=["relu_scale"]' in src
    assert "class ModelNew" in src and CODER_EXAMPLE_MODULE.count("def get_init_inputs") == 1
