"""Which processes form a data-parallel replica, and what a pipeline or tensor-parallel run cannot do.

Plans are made for the data-parallel size: the world divided by the pipeline stages and tensor ranks of
one replica. :func:`parallel_layout` reads it from the ``PipelineModule``'s grid or from DeepSpeed's
``mpu``; :func:`pipeline_problems` and :func:`model_parallel_problems` refuse, with the reason, what
cannot work there, so the run stops before DeepSpeed builds anything (and on every rank alike: each
check reads only the config and the arguments).
"""

from __future__ import annotations

from typing import Any

import torch

from ...config import ConfigError
from ...config.parallel import ParallelLayout, model_parallel_problems, pipeline_config_problems

__all__ = [
    "ParallelLayout",
    "is_pipeline_module",
    "model_parallel_problems",
    "parallel_layout",
    "pipeline_config_problems",
    "pipeline_problems",
]


def is_pipeline_module(model: Any) -> bool:
    try:
        from deepspeed.pipe import PipelineModule
    except ImportError:  # pragma: no cover - deepspeed is a dependency
        return False
    return isinstance(model, PipelineModule)


def parallel_layout(model: Any, mpu: Any, world_size: int, rank: int) -> ParallelLayout:
    """This process's layout, from the pipeline module's grid, an ``mpu``, or plain data parallelism."""
    if is_pipeline_module(model):
        grid = model.mpu()  # DeepSpeed 0.19.8: PipelineModule._grid, a PipelineParallelGrid
        return ParallelLayout(
            grid.get_data_parallel_world_size(),
            grid.get_data_parallel_rank(),
            grid.get_pipe_parallel_world_size(),
            grid.get_slice_parallel_world_size(),
            grid.get_slice_parallel_rank(),
        )
    if mpu is not None:
        # Megatron-style mpu: "model parallel" is the tensor-parallel group inside a replica.
        tensor_size = _call(mpu, ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"), 1)
        tensor_rank = _call(mpu, ("get_tensor_model_parallel_rank", "get_model_parallel_rank"), 0)
        return ParallelLayout(
            mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank(), 1, tensor_size, tensor_rank
        )
    return ParallelLayout(world_size, rank, 1, 1, 0)


def _call(obj: Any, names: tuple[str, ...], default: int) -> int:
    for name in names:
        fn = getattr(obj, name, None)
        if callable(fn):
            return int(fn())
    return default


def pipeline_problems(
    model: Any, loaded: Any, training_data: Any, loss_fn: Any, deepspeed_kwargs: dict, layout: ParallelLayout
) -> None:
    """Raise, with the reason, for whatever a ``PipelineModule`` run cannot do (before DeepSpeed starts)."""
    if "mpu" in deepspeed_kwargs:
        raise TypeError(
            "a PipelineModule brings its own grid (pipeline, data and tensor groups from its topology): "
            "do not pass mpu= with it"
        )
    if loss_fn is None and getattr(model, "loss_fn", None) is None:
        raise ValueError(
            "under pipeline parallelism the last stage computes the loss: build the PipelineModule with "
            "loss_fn=..., or pass loss_fn=lambda outputs, labels: ... to ds_adabatch.initialize"
        )
    if training_data is None or isinstance(training_data, torch.utils.data.IterableDataset):
        raise ValueError(
            "under pipeline parallelism training_data must be a map-style dataset (with __len__ and "
            "__getitem__): the first and the last stage of each replica must load identical "
            "micro-batches, which the global sample order guarantees; an IterableDataset or "
            "train_batch(data_iter) cannot"
        )
    problems = pipeline_config_problems(
        loaded, layout, dynamic_shape=bool(getattr(model, "dynamic_shape", False))
    )
    if problems:
        raise ConfigError(problems, loaded.source)
