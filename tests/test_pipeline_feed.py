"""The pipeline engine's pure parts in one process: filled rows, the weighted loss, layouts and refusals."""

from __future__ import annotations

import functools

import pytest
import torch

from ds_adabatch.config import load_ds_config
from ds_adabatch.runtime.initialize.layout import ParallelLayout, model_parallel_problems, parallel_layout
from ds_adabatch.runtime.pipeline.feed import (
    WeightedPipelineLoss,
    check_pipeline_batch,
    loss_reduction,
    pad_rows,
    rows_of,
)


def test_pad_rows_repeats_the_first_row_in_every_tensor():
    x, y = torch.arange(6.0).reshape(3, 2), torch.tensor([[1.0], [2.0], [3.0]])
    mask = torch.ones(3, 4, dtype=torch.bool)
    padded = pad_rows(((x, mask), y), 5)
    (px, pmask), py = padded
    assert rows_of(padded) == 5 and pmask.shape == (5, 4)
    assert torch.equal(px[:3], x) and torch.equal(px[3:], x[:1].expand(2, 2))
    assert torch.equal(py[3:], torch.tensor([[1.0], [1.0]]))
    assert pad_rows((x, y), 3) is not None and rows_of(pad_rows((x, y), 3)) == 3


@pytest.mark.parametrize("bad", [{"x": torch.zeros(2)}, (torch.zeros(2),), (torch.zeros(2), [1, 2])])
def test_a_batch_that_is_not_inputs_and_labels_is_named(bad):
    with pytest.raises(TypeError, match=r"\(inputs, labels\)"):
        check_pipeline_batch(bad)


def _mean_mse(out, y):
    return ((out - y) ** 2).mean()


def test_weighted_loss_uses_real_rows_and_weights_them():
    out = torch.tensor([[1.0], [2.0], [9.0], [9.0]], requires_grad=True)  # rows 2, 3: filled pads
    y = torch.zeros(4, 1)
    loss = WeightedPipelineLoss(_mean_mse, by_token=False)
    loss.expect([(2, 2, 0.5), (0, 0, 0.0)])
    got = loss(out, y)
    assert got.item() == pytest.approx((1.0 + 4.0) / 2 * 0.5)
    got.backward()
    assert out.grad[2:].abs().sum() == 0, "filled rows must not contribute"
    out.grad = None
    pad = loss(out, y)  # a pass with no real row: weighted 0 but still connected to the outputs
    pad.backward()
    assert pad.item() == 0.0 and out.grad is not None and out.grad.abs().sum() == 0


def test_weighted_loss_accepts_one_loss_per_row():
    out, y = torch.tensor([[1.0], [3.0], [5.0]]), torch.zeros(3, 1)
    per_row = WeightedPipelineLoss(lambda o, t: ((o - t) ** 2).flatten(), by_token=False)
    per_row.expect([(2, 2, 2 * 0.25)])  # (rows, count, weight = count x factor)
    assert per_row(out, y).item() == pytest.approx((1.0 + 9.0) * 0.25)


def test_weighted_loss_refuses_what_it_cannot_weigh():
    loss = WeightedPipelineLoss(lambda o, t: torch.zeros(2, 2), by_token=False)
    with pytest.raises(RuntimeError, match="outside an adaptive step"):
        loss(torch.zeros(2, 1), torch.zeros(2, 1))
    per_row = WeightedPipelineLoss(lambda o, t: (o - t).flatten(), by_token=False)
    with torch.no_grad():  # DeepSpeed's eval_batch: the user's loss, per-row losses averaged
        assert per_row(torch.tensor([[1.0], [3.0]]), torch.zeros(2, 1)).item() == 2.0
    loss.expect([(2, 2, 1.0)])
    with pytest.raises(TypeError, match="must return a tensor"):
        loss(torch.zeros(2, 1), torch.zeros(2, 1))
    tokens = WeightedPipelineLoss(lambda o, t: torch.zeros(2), by_token=True)
    tokens.expect([(2, 2, 1.0)])
    with pytest.raises(TypeError, match="target tokens"):
        tokens(torch.zeros(2, 1), torch.zeros(2, 1))


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of 3 rows (the last a filled pad) over 4 classes, and their labels."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 4, generator=g, requires_grad=True), torch.tensor([1, 3, 3])


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.nn.CrossEntropyLoss(),
        lambda: torch.nn.CrossEntropyLoss(reduction="sum"),
        lambda: torch.nn.CrossEntropyLoss(reduction="none"),
        lambda: functools.partial(torch.nn.functional.cross_entropy, reduction="sum"),
        lambda: functools.partial(functools.partial(torch.nn.functional.cross_entropy), reduction="none"),
        lambda: torch.nn.functional.cross_entropy,
    ],
    ids=["module-mean", "module-sum", "module-none", "partial-sum", "nested-partial-none", "function"],
)
def test_any_loss_and_reduction_gives_the_weighted_mean(make):
    """A module, a partial or a function, with whatever reduction it declares: mean over the real rows
    times the pass's weight (the two real rows of three, weight 0.3)."""
    out, y = _rows()
    want = torch.nn.functional.cross_entropy(out[:2], y[:2]) * 0.3
    loss = WeightedPipelineLoss(make(), by_token=False)
    loss.expect([(2, 2, 0.3)])
    got = loss(out, y)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    got.backward()
    assert out.grad[2].abs().sum() == 0, "the pad row must not contribute"


def test_a_loss_module_can_take_the_pipeline_modules_slot():
    """DeepSpeed's PipelineModule holds a loss module as a child: the wrapper must be a module too
    (torch refuses anything else there), and the user's module stays reachable as its child."""
    holder = torch.nn.Module()
    holder.loss_fn = torch.nn.CrossEntropyLoss(weight=torch.ones(4))
    wrapped = WeightedPipelineLoss(holder.loss_fn, by_token=False)
    holder.loss_fn = wrapped  # raised TypeError when the wrapper was not a Module
    assert holder.loss_fn is wrapped and "loss_fn.user_loss.weight" in dict(holder.named_buffers())


def test_token_sums_are_divided_by_the_passes_target_tokens():
    """Token normalisation with reduction 'sum' or 'none': the sum over the pass's target tokens
    (ignored positions give 0), divided by that count (5 tokens here), times the weight."""
    logits = torch.randn(2, 3, 4)
    labels = torch.tensor([[1, 2, -100], [0, 3, 1]])
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 4), labels.reshape(-1)) * 0.5
    for reduction in ("sum", "none"):
        loss = WeightedPipelineLoss(_TokenCrossEntropy(reduction), by_token=True)
        loss.expect([(2, 5, 0.5)])
        assert loss(logits, labels).item() == pytest.approx(want.item(), rel=1e-6), reduction


class _TokenCrossEntropy(torch.nn.Module):
    """A language model's loss module over [rows, positions, vocab] logits, with its own reduction."""

    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.reduction = reduction

    def forward(self, logits, labels):
        flat = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction=self.reduction
        )
        return flat if self.reduction != "none" else flat.reshape(labels.shape)


def test_an_unknown_reduction_is_refused():
    with pytest.raises(ValueError, match="reduction='mean', 'sum' or 'none'"):
        loss_reduction(torch.nn.CrossEntropyLoss(reduction="batchmean"))


class _Mpu:
    def get_data_parallel_world_size(self):
        return 2

    def get_data_parallel_rank(self):
        return 1

    def get_model_parallel_world_size(self):
        return 4

    def get_model_parallel_rank(self):
        return 3


def test_layouts_count_data_parallel_replicas():
    assert parallel_layout(torch.nn.Linear(1, 1), None, 8, 5) == ParallelLayout(8, 5, 1, 1, 0)
    assert parallel_layout(torch.nn.Linear(1, 1), _Mpu(), 8, 7) == ParallelLayout(2, 1, 1, 4, 3)


def test_gradient_noise_is_refused_where_a_replica_spans_processes():
    cfg = load_ds_config(
        {"adabatch": {"schedule": {"type": "gradient_noise", "start": 8}, "max_micro_batch_per_gpu": 4}}
    )
    assert model_parallel_problems(cfg, ParallelLayout(4, 0, 1, 1, 0)) == []
    (problem,) = model_parallel_problems(cfg, ParallelLayout(2, 0, 1, 2, 0))
    assert problem.path == "adabatch.schedule.type" and "tensor rank" in problem.message
    assert model_parallel_problems(cfg, ParallelLayout(1, 0, 1, 1, 0), pipelined=True)


def test_a_learned_micro_batch_is_refused_under_tensor_parallelism():
    cfg = load_ds_config(
        {"adabatch": {"schedule": {"type": "constant", "value": 8}, "max_micro_batch_per_gpu": "auto"}}
    )
    assert model_parallel_problems(cfg, ParallelLayout(4, 0, 1, 1, 0)) == []
    (problem,) = model_parallel_problems(cfg, ParallelLayout(2, 0, 1, 2, 0))
    assert problem.path == "adabatch.max_micro_batch_per_gpu" and "set a number" in problem.message
