"""Which processes form a data-parallel replica, and what a pipeline or tensor-parallel run cannot do.

Plans are made for the data-parallel size: the world divided by the pipeline stages and tensor ranks of
one replica. :func:`parallel_layout` reads it from the ``PipelineModule``'s grid or from DeepSpeed's
``mpu``; :func:`pipeline_problems` and :func:`model_parallel_problems` refuse, with the reason, what
cannot work there, so the run stops before DeepSpeed builds anything (and on every rank alike: each
check reads only the config and the arguments).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import ConfigError, ConfigProblem
from ..config.memory import AUTO

__all__ = [
    "ParallelLayout",
    "is_pipeline_module",
    "model_parallel_problems",
    "parallel_layout",
    "pipeline_problems",
]


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits: its data-parallel replica and what repeats inside one."""

    data_parallel_size: int
    """Replicas; plans are made for this many ranks."""
    data_parallel_rank: int
    """This process's replica (the rank its data loader serves)."""
    pipeline_stages: int
    """Stages of one replica (1 without pipelining)."""
    tensor_parallel_size: int
    """Tensor ranks of one stage (1 without tensor parallelism)."""
    tensor_parallel_rank: int

    def describe(self) -> str:
        return (
            f"{self.data_parallel_size} data-parallel x {self.pipeline_stages} pipeline stage(s) x "
            f"{self.tensor_parallel_size} tensor rank(s)"
        )


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


def model_parallel_problems(
    loaded: Any, layout: ParallelLayout, *, pipelined: bool = False
) -> list[ConfigProblem]:
    """What a replica spread over several processes (stages or tensor ranks) cannot measure or learn."""
    spread = layout.pipeline_stages * layout.tensor_parallel_size > 1
    problems = []
    cfg = loaded.adabatch
    if layout.tensor_parallel_size > 1 and cfg.max_micro_batch_per_gpu == "auto":
        problems.append(
            ConfigProblem(
                "adabatch.max_micro_batch_per_gpu",
                f'"auto" learns the micro-batch from out-of-memory errors, and with {layout.describe()} '
                "each one ends the job (the model's own tensor-parallel collectives leave no point in a "
                "pass where the ranks can agree to retry it): set a number",
                "auto",
            )
        )
    if cfg.schedule.type != "gradient_noise" or not (spread or pipelined):
        return problems
    return problems + [
        ConfigProblem(
            "adabatch.schedule.type",
            f"gradient_noise cannot be measured with {layout.describe()}{' (pipelined)' if pipelined else ''}: "
            "it reads every micro-batch's local gradient before DeepSpeed reduces it, and here a "
            "micro-batch's gradient is spread over stages or tensor ranks (DeepSpeed's PipelineEngine "
            "runs the passes itself). Use loss_plateau, seesaw or a sample-keyed ramp",
            "gradient_noise",
        )
    ]


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
    cfg, ds = loaded.adabatch, loaded.deepspeed
    problems: list[ConfigProblem] = []
    stage = int((ds.get("zero_optimization") or {}).get("stage", 0) or 0)
    if stage >= 2:
        problems.append(
            ConfigProblem(
                "zero_optimization.stage",
                "DeepSpeed 0.19.8 supports ZeRO stage 0 or 1 with pipeline parallelism: set it to 0 or 1",
                stage,
            )
        )
    if ds.get("managed_gradient_accumulation") is False:
        problems.append(
            ConfigProblem(
                "managed_gradient_accumulation",
                "DeepSpeed does not support caller-owned accumulation with pipeline parallelism: remove it",
                False,
            )
        )
    problems += model_parallel_problems(loaded, layout, pipelined=True)
    reason = (
        "out-of-memory recovery is not available under pipeline parallelism: a stage that fails "
        "mid-schedule leaves its neighbours blocked in point-to-point transfers of activations and "
        "gradients, which no agreement before a collective can release"
    )
    if cfg.max_micro_batch_per_gpu == AUTO:
        problems.append(
            ConfigProblem(
                "adabatch.max_micro_batch_per_gpu",
                f"'auto' learns the micro-batch from out-of-memory errors, and {reason}: give an integer",
                AUTO,
            )
        )
    elif "recover_from_oom" in cfg.memory.model_fields_set and cfg.memory.recover_from_oom:
        problems.append(ConfigProblem("adabatch.memory.recover_from_oom", f"{reason}: remove it", True))
    if cfg.token_budget and not getattr(model, "dynamic_shape", False):
        problems.append(
            ConfigProblem(
                "adabatch.micro_batch_tokens",
                "token-budget micro-batches change shape from pass to pass: build the PipelineModule with "
                "dynamic_shape=True so DeepSpeed sends activation shapes with every micro-batch",
                cfg.micro_batch_tokens,
            )
        )
    if problems:
        raise ConfigError(problems, loaded.source)
