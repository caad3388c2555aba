"""Input sets: sign-mixed sets for non-negative inputs, and fresh values for timed calls."""

from __future__ import annotations

import pytest
import torch

from kz_stream.verify import _inputs
from kz_stream.verify._inputs import (
    InputPlan,
    InputSpec,
    at_own_shapes,
    default_plans,
    fallbacks,
    make_inputs,
    moved_bytes,
    nbytes,
    odd_map,
    own_inputs,
    positive_,
    redraw_,
)


def test_non_negative_inputs_get_a_signed_set() -> None:
    own = [torch.rand(64, 64)]
    plans = default_plans(own)
    signed = [p for p in plans if p.signed]
    assert [p.label for p in signed] == ["signed"]
    x = make_inputs([InputSpec.of(own[0])], signed[0], seed=3)[0]
    assert bool((x < 0).any()) and bool((x > 0).any())
    normal = next(p for p in plans if p.label == "normal")
    assert bool((make_inputs([InputSpec.of(own[0])], normal, seed=3)[0] >= 0).all())


def test_sign_mixed_inputs_need_no_signed_set() -> None:
    assert not any(p.signed for p in default_plans([torch.randn(64, 64)]))
    assert any(p.signed for p in default_plans([torch.rand(64, 64)], small_only=True))


def test_redraw_gives_fresh_values_in_place_and_is_seeded() -> None:
    specs = [InputSpec.of(torch.rand(32, 16)), InputSpec.of(torch.randint(0, 10, (32,))),
             InputSpec.of(torch.rand(8) < 0.5), InputSpec(False, value=3)]
    values = [torch.rand(32, 16), torch.randint(0, 10, (32,)), torch.rand(8) < 0.5, 3]
    ptrs = [v.data_ptr() for v in values[:3]]
    before = [v.clone() for v in values[:3]]
    redraw_(values, specs, seed=11)
    assert [v.data_ptr() for v in values[:3]] == ptrs  # same storage, new values
    assert not torch.equal(values[0], before[0])
    assert bool((values[0] >= 0).all())  # the input's domain is kept
    assert int(values[1].min()) >= 0 and int(values[1].max()) <= 9
    again = [v.clone() for v in values[:3]]
    redraw_(values, specs, seed=11)
    assert all(torch.equal(a, b) for a, b in zip(values[:3], again, strict=True))
    redraw_(values, specs, seed=12)
    assert not torch.equal(values[0], again[0])


def test_sets_at_the_modules_own_shapes_are_told_apart() -> None:
    assert all(at_own_shapes(lb) for lb in ("own", "signed", "normal", "heavy", "odd"))
    assert not any(at_own_shapes(lb) for lb in ("small", "small-signed", "heavy@small"))


def test_the_last_fallback_scales_the_batch_dim_alone() -> None:
    """A batch of 32 with 32 input channels (KernelBench level 2, 3): scaling every 32
    breaks the convolution's weights, so the last fallback maps dim 0 and nothing else."""
    conv = torch.nn.Conv3d(32, 8, 3)
    own = [torch.rand(32, 32, 16, 32, 32)]
    plan = InputPlan("odd", "normal", odd_map(own))
    last = fallbacks(plan, own)[-1]
    assert last.lead_only and not last.scale_init
    (x,) = make_inputs([InputSpec.of(v) for v in own], last, seed=0)
    assert tuple(x.shape) == (31, 32, 16, 32, 32)
    assert conv(x).shape[:2] == (31, 8)


def test_a_batch_only_plan_leaves_class_labels_alone() -> None:
    """Labels index classes, not the batch: they keep their range when only dim 0 scales."""
    own = [torch.randn(64, 10), torch.randint(0, 64, (64,))]
    plan = InputPlan("small", "normal", {64: 9}, scale_init=False, lead_only=True)
    logits, labels = make_inputs([InputSpec.of(v) for v in own], plan, seed=0)
    assert tuple(logits.shape) == (9, 10) and tuple(labels.shape) == (9,)
    assert int(labels.max()) > 9  # drawn from the full 0..63 range


def _rand_inputs() -> list[torch.Tensor]:
    return [torch.rand(3, 5), torch.randint(0, 7, (4,))]


def test_own_inputs_on_the_host_are_the_generators_under_the_seed() -> None:
    first, again = own_inputs(_rand_inputs, 11, "cpu"), own_inputs(_rand_inputs, 11, "cpu")
    torch.manual_seed(11)
    assert all(torch.equal(a, b) for a, b in zip(first, _rand_inputs(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_own_inputs_are_drawn_on_the_device_and_on_the_host_when_that_fails() -> None:
    seen: list[str] = []

    def plain() -> list[torch.Tensor]:
        seen.append(torch.empty(0).device.type)  # where torch.rand would draw
        return [torch.rand(2, 3)]

    def host_only() -> list[torch.Tensor]:
        seen.append(torch.empty(0).device.type)
        x = torch.rand(2, 3)
        assert x.sum().item() >= 0  # reads a value: no meta tensor can
        return [x]

    # "meta" stands in for a GPU here: a device with no values.
    assert [v.device.type for v in own_inputs(plain, 3, "meta")] == ["meta"]
    assert seen == ["meta"]
    seen.clear()
    assert [v.device.type for v in own_inputs(host_only, 3, "meta")] == ["meta"]
    assert seen == ["meta", "cpu"]


def test_moments_in_blocks_match_a_whole_float64_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_inputs, "_MOMENT_BLOCK", 1000)  # 37 blocks, the last one short
    torch.manual_seed(0)
    for v in (torch.randn(36_001) * 3 + 1e4, torch.rand(36_001), torch.tensor([2.5])):
        mean, std, nonneg = _inputs._moments(v.to(torch.float16).float())
        ref = v.to(torch.float16).double()
        assert mean == pytest.approx(float(ref.mean()), rel=1e-12)
        assert std == pytest.approx(float(ref.std()) if ref.numel() > 1 else 0.0, rel=1e-9)
        assert nonneg is bool((ref >= 0).all())
    v = torch.rand(5000)
    v[4321] = float("nan")  # a NaN is not non-negative
    assert _inputs._moments(v)[2] is False


def test_moved_bytes_count_elements_not_the_buffer_a_loss_views() -> None:
    p, t = torch.rand(64, 32), torch.rand(64, 32)
    loss = torch.nn.functional.smooth_l1_loss(p, t)
    assert nbytes([loss]) >= p.nbytes  # it holds the elementwise buffer...
    assert moved_bytes([loss]) == 4  # ...and moves one float
    assert moved_bytes([p, t, loss]) == 2 * p.nbytes + 4


def test_moved_bytes_count_each_storage_at_most_once() -> None:
    x = torch.rand(16, 16)
    assert moved_bytes([x, x]) == x.nbytes
    assert moved_bytes([x[:8], x[8:]]) == x.nbytes
    assert moved_bytes([x[:, :1]]) == 16 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_non_negative_input_is_drawn_positive_even_where_the_generator_gives_zero(
        dtype: torch.dtype) -> None:
    # The log of a drawn 0 made KernelBench's KL divergence infinite on the GPU.
    x = torch.tensor([-0.5, 0.0, -0.0, 2.0, 1e-30])
    positive_(x, dtype)
    assert (x.to(dtype) > 0).all()
    assert x[0] == 0.5 and x[3] == 2.0
    assert x[1] == torch.finfo(dtype).tiny
