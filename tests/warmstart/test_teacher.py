"""The Triton teacher: every op it lowers computes what the module computes."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kz_stream.llm import SamplingParams
from kz_stream.modules import coder_messages, extract_code, fence_code
from kz_stream.warmstart.ops import OPS
from kz_stream.warmstart.synth import Synthesizer, synthesize
from kz_stream.warmstart.teacher import TeacherBackend, TeacherError, lower

# Runs each (module, kernel) pair under the Triton interpreter on the module's inputs and
# on odd sizes, against the module run in float64; the error is in units of the module's own
# float32 error (the verifier accepts up to 32 of them).
CHECK = r"""
import inspect, json, sys, types, torch
pairs = json.load(sys.stdin)
out = []
for module_src, kernel_src in pairs:
    ref, new = types.ModuleType("ref"), types.ModuleType("new")
    exec(module_src, ref.__dict__)
    exec(kernel_src, new.__dict__)
    errors = []
    for trim in (0, 1):
        torch.manual_seed(0)
        init = ref.get_init_inputs()
        inputs = ref.get_inputs()
        if trim:  # odd sizes: a column fewer (1023 for 1024), or a row if a layer fixes the width
            names = list(inspect.signature(ref.Model.forward).parameters)[1:]
            dim = 0 if init or "w" in names else -1
            inputs = [t if n == "w" else t.narrow(dim, 0, t.shape[dim] - 1).contiguous()
                      for n, t in zip(names, inputs)]
        torch.manual_seed(1)
        model = ref.Model(*init)
        torch.manual_seed(1)
        model_new = new.ModelNew(*init)
        own = model(*inputs).double()  # the module's own float32 error sets the bar
        expected = model.double()(*[t.double() for t in inputs])
        got = model_new(*inputs)
        assert got.shape == expected.shape and got.dtype == torch.float32, got.shape
        floor = 16 * 2.0**-23 * expected.pow(2).mean().sqrt().item()
        bar = max((own - expected).abs().max().item(), floor, 1e-30)
        errors.append((got.double() - expected).abs().max().item() / bar)
    out.append(max(errors))
print(json.dumps(out))
"""


def check_in_interpreter(pairs: list[tuple[str, str]]) -> list[float]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", CHECK], input=json.dumps(pairs), env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return list(json.loads(done.stdout))


def test_every_op_is_lowered_correctly() -> None:
    rng = random.Random(5)
    pairs = []
    for op in OPS:
        module = synthesize([op.api], rng)
        pairs.append((module.source, lower(module.source)))
    errors = check_in_interpreter(pairs)
    bad = {op.api: e for op, e in zip(OPS, errors, strict=True) if not e <= 32}
    assert bad == {}


def test_fused_modules_of_every_kind_are_lowered_correctly() -> None:
    modules = list(Synthesizer(seed=2).modules(30))
    assert {m.kind for m in modules} == {"single", "fused", "norm", "reduction", "matmul"}
    errors = check_in_interpreter([(m.source, lower(m.source)) for m in modules])
    bad = [(m.api_set, e) for m, e in zip(modules, errors, strict=True) if not e <= 32]
    assert bad == []


def test_the_answer_is_one_self_contained_triton_file() -> None:
    module = synthesize(["torch.nn.Linear", "torch.relu", "torch.softmax"], random.Random(0))
    kernel = lower(module.source)
    assert kernel.count("@triton.jit") == 2 and "class ModelNew(nn.Module)" in kernel
    assert "torch._inductor" not in kernel and "torch.relu" not in kernel
    assert "torch.softmax" not in kernel and "self.linear(" not in kernel
    assert 'input_precision="ieee"' in kernel  # no TF32 on float32 data


def test_modules_outside_the_vocabulary_are_refused_with_the_reason() -> None:
    source = synthesize(["torch.sin"], random.Random(0)).source
    with pytest.raises(TeacherError, match=r"no lowering for `torch\.conv2d"):
        lower(source.replace("torch.sin(x)", "torch.conv2d(x, x)"))
    with pytest.raises(TeacherError, match="not of the form"):
        lower(source.replace("x = torch.sin(x)", "y = torch.sin(x)"))


def test_the_teacher_answers_coder_prompts_as_a_policy() -> None:
    module = synthesize(["torch.sigmoid", "torch.sum"], random.Random(0))
    teacher = TeacherBackend()
    prompts = [coder_messages(module.source, "triton"),
               coder_messages(module.source.replace("torch.sum(x, dim=-1)", "torch.sort(x)"),
                              "triton")]
    answers = asyncio.run(teacher.generate(prompts, n=2, sampling=SamplingParams()))
    assert [len(a) for a in answers] == [2, 2]
    assert extract_code(answers[0][0].text, require="class ModelNew") == lower(module.source)
    assert extract_code(answers[1][0].text, require="class ModelNew") is None
    assert "no lowering for `torch.sort(x)`" in answers[1][0].text


def test_synthesizer_sources_are_written_in_the_teachers_form(tmp_path: Path) -> None:
    for module in Synthesizer(seed=4).modules(100):
        lower(module.source)  # raises if any module falls outside the teacher's form


def test_kz_runs_token_caps_hold_the_answers_the_warm_models_learned() -> None:
    """The Coder's cap holds the teacher's answer to every synthesized module (with a
    matmul it takes up to about 1,200 tokens: a cap of 640 cut every one of them into a
    syntax error), and the Proposer's cap every synthesized module."""
    from transformers import AutoTokenizer

    from kz_stream.app import RunOptions
    from kz_stream.config import Settings
    from kz_stream.llm import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir()))

    def tokens(code: str) -> int:  # the SFT rows' answer form, and its end token
        return len(tokenizer(fence_code(code))["input_ids"]) + 1

    kernels = [tokens(lower(m.source)) for m in Synthesizer(seed=0).modules(200)]
    modules = [tokens(m.source) for m in Synthesizer(seed=0, teachable=False).modules(200)]
    options = RunOptions()
    assert 640 < max(kernels) <= options.max_new_tokens
    assert max(kernels) <= Settings().coder.llm.max_tokens  # kz serve, kz eval run
    assert max(modules) <= options.proposer_max_new_tokens
