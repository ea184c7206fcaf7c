"""The pipeline engine's pure parts in one process: filled rows, the weighted loss, layouts and refusals."""

from __future__ import annotations

import pytest
import torch

from ds_adabatch.config import load_ds_config
from ds_adabatch.runtime.parallel_layout import ParallelLayout, model_parallel_problems, parallel_layout
from ds_adabatch.runtime.pipeline_feed import WeightedPipelineLoss, check_pipeline_batch, pad_rows, rows_of


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
    loss.expect([(2, 0.5), (0, 0.0)])
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
    per_row.expect([(2, 2 * 0.25)])  # weight = count x factor
    assert per_row(out, y).item() == pytest.approx((1.0 + 9.0) * 0.25)


def test_weighted_loss_refuses_what_it_cannot_weigh():
    loss = WeightedPipelineLoss(lambda o, t: torch.zeros(2, 2), by_token=False)
    with pytest.raises(RuntimeError, match="outside an adaptive step"):
        loss(torch.zeros(2, 1), torch.zeros(2, 1))
    per_row = WeightedPipelineLoss(lambda o, t: (o - t).flatten(), by_token=False)
    with torch.no_grad():  # DeepSpeed's eval_batch: the user's loss, per-row losses averaged
        assert per_row(torch.tensor([[1.0], [3.0]]), torch.zeros(2, 1)).item() == 2.0
    loss.expect([(2, 1.0)])
    with pytest.raises(TypeError, match="must return a tensor"):
        loss(torch.zeros(2, 1), torch.zeros(2, 1))
    tokens = WeightedPipelineLoss(lambda o, t: torch.zeros(2), by_token=True)
    tokens.expect([(2, 1.0)])
    with pytest.raises(TypeError, match="target tokens"):
        tokens(torch.zeros(2, 1), torch.zeros(2, 1))


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
