"""What a problem's preparation holds on the host, known before it runs: the reference's
sizes on the meta device, and the memory plan's arithmetic."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kz_stream.verify._inputs import small_set_share
from kz_stream.verify._preflight import module_footprint, reference_facts
from kz_stream.verify._prepared import _held_bytes
from kz_stream.verify._reference import load_reference
from kz_stream.verify._verifier import preparation_bytes

GB = 10**9

# KernelBench level 1, 19 (ReLU) at its published size: 6.4 GB of float32 input.
RELU_FULL = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.rand(4096, 393216)]


def get_init_inputs():
    return []
'''

# A loss: two inputs, one 0-dim output.
MSE_FULL = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, a, b):
        return torch.mean((a - b) ** 2)


def get_inputs():
    return [torch.rand(32768, 32768), torch.rand(32768, 32768)]


def get_init_inputs():
    return []
'''

# A forward the meta device cannot run (it reads a value).
READS_A_VALUE = RELU_FULL.replace("return torch.relu(x)",
                                  "return x * float(x.sum())")


def reference_footprint(source: str) -> tuple[int, int | None, int]:
    return module_footprint(load_reference(source, str(Path.cwd())))


@pytest.fixture(autouse=True)
def _in_a_scratch_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # It runs in a sandbox's folder, where it writes the reference's module file.
    monkeypatch.chdir(tmp_path)


def test_the_footprint_comes_from_the_meta_device_without_memory() -> None:
    # A float32 output is kept as returned (4 bytes an element) and in float64 (8).
    assert reference_footprint(RELU_FULL) == (4096 * 393216 * 4, 4096 * 393216 * 12, 0)
    assert reference_footprint(MSE_FULL) == (2 * 32768 * 32768 * 4, 12, 0)


def test_the_outputs_kept_follow_their_dtype() -> None:
    # float16 grows fivefold (2 + 8 bytes); an int64 argmax and a bool mask are kept in
    # their own dtype by the float64 run too.
    half = RELU_FULL.replace("torch.rand(4096, 393216)", "torch.rand(64, 64).half()")
    argmax = RELU_FULL.replace("torch.relu(x)", "torch.argmax(x, dim=1)").replace(
        "torch.rand(4096, 393216)", "torch.rand(64, 64)")
    mask = RELU_FULL.replace("torch.relu(x)", "x > 0.5").replace(
        "torch.rand(4096, 393216)", "torch.rand(64, 64)")
    assert reference_footprint(half)[1] == 64 * 64 * (2 + 8)
    assert reference_footprint(argmax)[1] == 64 * (8 + 8)
    assert reference_footprint(mask)[1] == 64 * 64 * (1 + 1)


def test_an_output_the_meta_device_cannot_give_is_unknown() -> None:
    assert reference_footprint(READS_A_VALUE) == (4096 * 393216 * 4, None, 0)


LINEAR = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)

    def forward(self, x):
        return self.fc(x)


def get_inputs():
    return [torch.rand(8, 64)]


def get_init_inputs():
    return [64, 32]
'''


def test_one_child_tells_the_init_arguments_and_the_footprint() -> None:
    # The last value: the share of the own set a set at an eighth keeps (batch 8 -> 1).
    assert reference_facts(LINEAR) == ([64, 32], 8 * 64 * 4, 8 * 32 * 12,
                                       (64 * 32 + 32) * 4, 1 / 8)
    assert reference_facts(RELU_FULL) == ([], 4096 * 393216 * 4, 4096 * 393216 * 12, 0,
                                          513 / 4096)


def test_the_footprint_counts_the_models_weights_on_the_meta_device() -> None:
    # KernelBench level 3's MLP at width 16384 is 671M parameters: 2.7 GB a model.
    wide = LINEAR.replace("return [64, 32]", "return [16384, 16384]").replace(
        "torch.rand(8, 64)", "torch.rand(8, 16384)")
    assert reference_footprint(wide)[2] == (16384 * 16384 + 16384) * 4


def test_a_small_problem_holds_five_full_sets_and_a_small_one_once() -> None:
    own = 1_000 + 3_000  # inputs, honest and float64 outputs (float32)
    assert preparation_bytes(1_000, 3_000, 16 * GB) == 5 * own + own // 8
    assert preparation_bytes(1_000, 3_000, 0) == 5 * own + own // 8  # 0: no bound


def test_past_the_budget_the_other_sets_count_an_eighth() -> None:
    # The ReLU's own set (input, honest and float64 output) is 25.8 GB: a second full
    # set would pass the 16 GiB budget, so the oracle runs the five others at an eighth
    # of the shapes. Prepared alone on an H100 host it took 25.8 GiB (2026-12-06).
    relu = 4096 * 393216 * 4
    own = 4 * relu
    assert preparation_bytes(relu, 3 * relu, 16 * 2**30) == own + 5 * (own // 8)
    assert preparation_bytes(relu, 3 * relu, 16 * 2**30) == 39 * 2**30


def test_whole_sets_join_the_own_one_while_they_fit_the_budget() -> None:
    # As the oracle adds them: a set at the module's shapes is full size only if all the
    # full-size sets, it included, stay within the budget; the rest and the small set
    # are at an eighth.
    own = 4 * 1_000
    assert preparation_bytes(1_000, 3_000, 3 * own) == 3 * own + 3 * (own // 8)
    assert preparation_bytes(1_000, 3_000, 3 * own - 1) == 2 * own + 4 * (own // 8)


def test_weights_count_for_the_own_model_the_odd_one_and_an_eighth_for_the_small() -> None:
    weights = 8 * 10**9
    assert preparation_bytes(1_000, 3_000, 16 * GB, weights) == (
        preparation_bytes(1_000, 3_000, 16 * GB) + 2 * weights + weights // 8)


def test_prepared_sets_hold_their_models_weights_once_per_model() -> None:
    w = {"weight": torch.zeros(1000), "bias": torch.zeros(10)}  # 4,040 bytes
    sets = [{"bytes": 100, "state_dict": w}, {"bytes": 100, "state_dict": None},
            {"bytes": 10, "state_dict": {"weight": torch.zeros(100)}}]
    assert _held_bytes(sets) == 210 + 4_040 + 400  # type: ignore[arg-type]


def test_an_unknown_output_counts_as_a_float32_one_as_large_as_the_inputs() -> None:
    assert preparation_bytes(10, None, 10**6) == preparation_bytes(10, 30, 10**6)


def test_a_set_at_an_eighth_can_keep_more_than_an_eighth_of_a_small_batch() -> None:
    # Its last fallback scales the leading dim alone, to an odd size: KernelBench's group
    # norm (batch 112) kept 15/112 and held 3% more than an eighth's bound (H100 audit,
    # 2026-12-06); a batch of 2 keeps one row, half of it.
    assert small_set_share([torch.empty(112, 64, 4, 4)]) == 15 / 112
    assert small_set_share([torch.empty(2, 1000), torch.empty(())]) == pytest.approx(
        (2 * 1000 * 4 / 2 + 4) / (2 * 1000 * 4 + 4))
    assert small_set_share([3]) == 1 / 8  # no tensor: the plain eighth
    own = 1_000 + 3_000
    assert preparation_bytes(1_000, 3_000, own, 0, 15 / 112) == own + 5 * math.ceil(
        own * 15 / 112)
