"""A model split over tensor ranks for the tests: column- and row-parallel linears over an mpu's group.

``TensorGrid`` is a Megatron-style mpu over ``torch.distributed`` groups; ``TensorParallelMLP`` is
``Linear(5, 16), Tanh, Linear(16, 1)`` (``mlp3``) with the first layer split by output columns and the
second by input rows, the partial outputs summed over the tensor group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def mlp3(seed: int = 0) -> list[torch.nn.Module]:
    """The tensor-parallel test's model before it is split: Linear(5, 16), Tanh, Linear(16, 1)."""
    torch.manual_seed(seed)
    return [torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)]


class TensorGrid:
    """A Megatron-style mpu: ranks [0, 1] and [2, 3] are tensor groups, [0, 2] and [1, 3] data-parallel."""

    def __init__(self, tensor: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tensor, self.dp = tensor, world // tensor
        self.tp_rank, self.dp_rank = rank % tensor, rank // tensor
        for d in range(self.dp):  # every rank must create every group
            g = torch.distributed.new_group([d * tensor + t for t in range(tensor)])
            if d == self.dp_rank:
                self.tp_group = g
        for t in range(tensor):
            ranks = [d * tensor + t for d in range(self.dp)]
            g = torch.distributed.new_group(ranks)
            if t == self.tp_rank:
                self.dp_group, self.dp_ranks = g, ranks

    def get_model_parallel_rank(self):
        return self.tp_rank

    def get_model_parallel_world_size(self):
        return self.tensor

    def get_model_parallel_group(self):
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return self.dp

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_group_ranks(self):
        return self.dp_ranks


class _ReduceFromTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TensorParallelMLP(torch.nn.Module):
    """Linear(5, 16) split by output columns, Linear(16, 1) split by input rows, over ``grid``'s tensor group."""

    def __init__(self, grid: TensorGrid):
        super().__init__()
        full = mlp3()
        w1, b1, w2, b2 = full[0].weight, full[0].bias, full[2].weight, full[2].bias
        k, r = 16 // grid.tensor, grid.tp_rank
        self.w1 = torch.nn.Parameter(w1.detach()[r * k : (r + 1) * k].clone())
        self.b1 = torch.nn.Parameter(b1.detach()[r * k : (r + 1) * k].clone())
        self.w2 = torch.nn.Parameter(w2.detach()[:, r * k : (r + 1) * k].clone())
        self.b2 = torch.nn.Parameter(b2.detach().clone())
        self.group, self.k, self.r = grid.tp_group, k, r

    def forward(self, x):
        h = torch.tanh(x @ self.w1.t() + self.b1)
        return _ReduceFromTensor.apply(h @ self.w2.t(), self.group) + self.b2

    def reference_slices(self, ref: torch.nn.Sequential) -> torch.Tensor:
        k, r = self.k, self.r
        return torch.cat(
            [
                ref[0].weight.detach()[r * k : (r + 1) * k].flatten(),
                ref[0].bias.detach()[r * k : (r + 1) * k].flatten(),
                ref[2].weight.detach()[:, r * k : (r + 1) * k].flatten(),
                ref[2].bias.detach().flatten(),
            ]
        )


def tensor_loss(engine, batch):
    x, y = batch
    return (
        (engine(x.to(torch.bfloat16 if engine.bfloat16_enabled() else torch.float32)).float() - y) ** 2
    ).mean()


# -- 3D: pipeline stages whose layers are split over the stage's tensor ranks ----------------------------
def mlp_3d(seed: int = 0) -> list[torch.nn.Module]:
    """The 3D test's model before it is split: two blocks ``Linear, Tanh, Linear`` (5 -> 16 -> 16 and,
    after a Tanh, 16 -> 16 -> 1), one per pipeline stage."""
    torch.manual_seed(seed)
    return [
        torch.nn.Linear(5, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 1),
    ]


class _CopyToTensor(torch.autograd.Function):
    """Identity forward; the input's gradient summed over the tensor group (each rank's columns add)."""

    @staticmethod
    def forward(ctx, x, group_fn):
        ctx.group_fn = group_fn
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group_fn())
        return grad, None


class _ReduceFromTensorLazy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_fn):
        x = x.clone()
        torch.distributed.all_reduce(x, group=group_fn())
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TensorBlock(torch.nn.Module):
    """``[Tanh], Linear(a, 16), Tanh, Linear(16, b)`` of ``mlp_3d`` split over a pipeline stage's tensor
    ranks (the first Linear by output columns, the second by input rows, the outputs summed), reading the
    tensor group from the PipelineModule's grid when it runs (``group_fn``): the Megatron layout, whose
    activations between stages are the same on every tensor rank (DeepSpeed partitions them in transit)."""

    def __init__(self, first: int, tensor: int, tp_rank: int, group_fn, *, pre_tanh: bool) -> None:
        super().__init__()
        full = mlp_3d()
        lin1, lin2 = full[first], full[first + 2]
        k, r = 16 // tensor, tp_rank
        self.w1 = torch.nn.Parameter(lin1.weight.detach()[r * k : (r + 1) * k].clone())
        self.b1 = torch.nn.Parameter(lin1.bias.detach()[r * k : (r + 1) * k].clone())
        self.w2 = torch.nn.Parameter(lin2.weight.detach()[:, r * k : (r + 1) * k].clone())
        self.b2 = torch.nn.Parameter(lin2.bias.detach().clone())
        self.first, self.k, self.r, self.group_fn, self.pre_tanh = first, k, r, group_fn, pre_tanh

    def forward(self, x):
        if self.pre_tanh:
            x = torch.tanh(x)
        x = _CopyToTensor.apply(x, self.group_fn)
        h = torch.tanh(x @ self.w1.t() + self.b1)
        return _ReduceFromTensorLazy.apply(h @ self.w2.t(), self.group_fn) + self.b2

    def reference_slices(self, ref: torch.nn.Sequential) -> torch.Tensor:
        k, r = self.k, self.r
        lin1, lin2 = ref[self.first], ref[self.first + 2]
        return torch.cat(
            [
                lin1.weight.detach()[r * k : (r + 1) * k].flatten(),
                lin1.bias.detach()[r * k : (r + 1) * k].flatten(),
                lin2.weight.detach()[:, r * k : (r + 1) * k].flatten(),
                lin2.bias.detach().flatten(),
            ]
        )
