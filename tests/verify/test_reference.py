"""Building the reference: perturbed weights drawn once per model, the same as ever."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from kz_stream.testing.perturb import perturb_first_form
from kz_stream.verify._reference import (
    ReferenceModule,
    build_model,
    copies_faithfully,
    float64_copy,
    forget_built_models,
    perturb_,
    run,
)


class Counted(nn.Module):
    """A module that counts its constructions, with every kind of state perturb_ meets."""

    built: ClassVar[int] = 0

    def __init__(self, width: int, scale: Any = 1.0) -> None:
        super().__init__()
        Counted.built += 1
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)  # ones and zeros before the noise
        self.wide = nn.Parameter(torch.randn(3, dtype=torch.float64))
        self.one = nn.Parameter(torch.tensor([0.5]))
        self.register_buffer("steps", torch.zeros(2, dtype=torch.long))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x)) * self.wide.sum() * self.one


def _reference() -> ReferenceModule:
    return ReferenceModule(Counted, lambda: [torch.rand(2, 8)], lambda: [8])


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    forget_built_models()
    Counted.built = 0
    yield
    forget_built_models()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_perturbation_draws_the_same_weights_as_the_plain_expressions() -> None:
    torch.manual_seed(3)
    mine = Counted(64)
    theirs = Counted(64)
    theirs.load_state_dict(mine.state_dict())
    perturb_(mine, 11)
    perturb_first_form(theirs, 11)
    _assert_same(_state(mine), _state(theirs))


def test_a_model_built_again_is_a_copy_with_a_fresh_builds_weights_and_rng_state() -> None:
    ref = _reference()
    first = build_model(ref, [8], 5, "cpu")
    after_first = torch.get_rng_state()
    weights = _state(first)
    first.linear.weight.data.zero_()  # a run that changes its model changes no later build
    torch.rand(4)  # nor does what happened to the RNG since
    second = build_model(ref, [8], 5, "cpu")
    assert Counted.built == 1
    _assert_same(_state(second), weights)
    assert torch.equal(torch.get_rng_state(), after_first)
    assert second is not first

    forget_built_models()
    fresh = build_model(ref, [8], 5, "cpu")
    assert Counted.built == 2
    _assert_same(_state(fresh), weights)


def test_other_arguments_or_another_seed_build_anew() -> None:
    ref = _reference()
    eight = _state(build_model(ref, [8], 5, "cpu"))
    other_seed = _state(build_model(ref, [8], 6, "cpu"))
    sixteen = build_model(ref, [16], 5, "cpu")
    assert Counted.built == 3
    assert not torch.equal(eight["linear.weight"], other_seed["linear.weight"])
    assert sixteen.linear.weight.shape == (16, 16)
    _assert_same(_state(build_model(ref, [8], 5, "cpu")), eight)


def test_arguments_whose_repr_elides_them_are_never_taken_for_each_other() -> None:
    ref = _reference()
    a, b = torch.zeros(2000), torch.zeros(2000)
    b[1000] = 1.0  # the same repr ("tensor([0., 0., ..., 0., 0.])"), different values
    assert repr(a) == repr(b)
    build_model(ref, [8, a], 5, "cpu")
    build_model(ref, [8, b], 5, "cpu")
    assert Counted.built == 2


class MakesFloat32(nn.Module):
    """Makes a float32 tensor in its forward (an LSTM's hidden state from ``randn``) and
    writes into a float32 buffer it made."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.randn(x.shape[0], 4)  # float32 whatever x is
        out = torch.zeros(x.shape[0], 4)
        out[:, :2] = self.linear(x)[:, :2] + h[:, :2]
        out += h
        return torch.mm(out, torch.ones(4, 4))


class KeepsAClosure(nn.Module):
    """Keeps a function over its own submodule, as KernelBench 3/44's GPT block does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        m = self.linear
        self.apply_linear = lambda x: m(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply_linear(x).relu()


def test_a_forward_that_makes_float32_tensors_runs_in_float64_with_the_same_draws() -> None:
    model, x = MakesFloat32(), torch.randn(3, 4)
    torch.manual_seed(1)
    honest = run(model, [x], "cpu")[0]
    torch.manual_seed(1)
    expected = run(float64_copy(model), [x], "cpu", torch.float64)[0]
    torch.manual_seed(1)
    h = torch.randn(3, 4).double()  # what the forward drew, upcast
    out = torch.zeros(3, 4, dtype=torch.float32)  # its buffer keeps its precision
    out[:, :2] = (torch.nn.functional.linear(x.double(), model.linear.weight.double(),
                                             model.linear.bias.double())[:, :2] + h[:, :2])
    out += h
    assert expected.dtype == torch.float64
    assert torch.equal(expected, out.double() @ torch.ones(4, 4, dtype=torch.float64))
    assert (expected - honest.double()).abs().max() < 1e-5
    assert model.linear.weight.dtype == torch.float32  # left as it was


def test_a_module_that_closes_over_its_submodules_runs_in_float64_with_its_own_weights(
) -> None:
    model, x = KeepsAClosure(), torch.randn(3, 4)
    assert not copies_faithfully(model) and copies_faithfully(MakesFloat32())
    expected = run(float64_copy(model), [x], "cpu", torch.float64)[0]
    w, b = model.linear.weight.double(), model.linear.bias.double()
    assert expected.dtype == torch.float64
    assert torch.equal(expected, torch.nn.functional.linear(x.double(), w, b).relu())


def test_a_module_that_closes_over_its_submodules_is_built_afresh_not_copied() -> None:
    ref = ReferenceModule(KeepsAClosure, lambda: [torch.rand(2, 4)], lambda: [])
    first = build_model(ref, [], 5, "cpu")
    second = build_model(ref, [], 5, "cpu")
    _assert_same(_state(first), _state(second))
    first.linear.weight.data.zero_()  # the second's function runs the second's weights
    x = torch.randn(2, 4)
    assert torch.equal(second(x), second.linear(x).relu())
