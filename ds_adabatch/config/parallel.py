"""What a replica spread over pipeline stages or tensor ranks cannot do, read from the config alone.

Plans are made for the data-parallel size: the world divided by the pipeline stages and tensor ranks of
one replica (:class:`ParallelLayout`). :func:`model_parallel_problems` and
:func:`pipeline_config_problems` list what the config asks that such a layout cannot do; ``initialize``
raises them before DeepSpeed builds anything, and ``ds-adabatch validate --pipeline-stages S
--tensor-parallel-size T`` prints the same (this module imports neither torch nor DeepSpeed).
:func:`caller_accumulation_problems` lists what DeepSpeed's caller-owned accumulation
(``"managed_gradient_accumulation": false``) cannot be combined with; ``initialize`` raises them before
any process group starts (DeepSpeed itself would assert inside its engine, after it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .adaptive_schedules import measures_noise
from .errors import ConfigProblem
from .memory import AUTO

__all__ = [
    "ParallelLayout",
    "caller_accumulation_problems",
    "model_parallel_problems",
    "pipeline_config_problems",
]

_MANAGED = "managed_gradient_accumulation"


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
    kind = cfg.schedule.type
    if kind not in ("gradient_noise", "goodput") or not (spread or pipelined):
        return problems
    if not pipelined:
        where = "a micro-batch's gradient is spread over tensor ranks"
    elif layout.pipeline_stages > 1:
        where = "DeepSpeed's PipelineEngine runs the passes itself and a micro-batch's gradient is spread over stages"
    else:
        where = "DeepSpeed's PipelineEngine runs the passes itself"
    return problems + [
        ConfigProblem(
            "adabatch.schedule.type",
            f"{kind} cannot be measured with {layout.describe()}{' (pipelined)' if pipelined else ''}: "
            "the gradient-noise scale it reads comes from every micro-batch's local gradient before "
            f"DeepSpeed reduces it, and here {where}. Use loss_plateau, seesaw or a sample-keyed ramp",
            kind,
        )
    ]


def pipeline_config_problems(
    loaded: Any, layout: ParallelLayout, *, dynamic_shape: bool | None = None
) -> list[ConfigProblem]:
    """What the config asks of a pipeline run that it cannot do (``initialize`` and ``ds-adabatch
    validate --pipeline-stages`` refuse the same). ``dynamic_shape``: the module's, where known."""
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
    problems += caller_accumulation_problems(ds, pipelined=True)
    configured = (ds.get("pipeline") or {}).get("stages")
    if (
        isinstance(configured, int)
        and not isinstance(configured, bool)
        and configured != layout.pipeline_stages
    ):
        problems.append(
            ConfigProblem(
                "pipeline.stages",
                f"the config says {configured} pipeline stages and the PipelineModule (or "
                f"--pipeline-stages) has {layout.pipeline_stages}: make them agree, or remove pipeline.stages",
                configured,
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
    if cfg.token_budget and dynamic_shape is False:
        problems.append(
            ConfigProblem(
                "adabatch.micro_batch_tokens",
                "token-budget micro-batches change shape from pass to pass: build the PipelineModule with "
                "dynamic_shape=True so DeepSpeed sends activation shapes with every micro-batch",
                cfg.micro_batch_tokens,
            )
        )
    return problems


def caller_accumulation_problems(
    ds: dict[str, Any], *, pipelined: bool = False, schedule: Any = None
) -> list[ConfigProblem]:
    """What ``"managed_gradient_accumulation": false`` in ``ds`` (the DeepSpeed part of the config) is
    combined with that DeepSpeed 0.19.8 refuses (``DeepSpeedEngine._do_sanity_check`` asserts it inside
    ``deepspeed.initialize``, after the process group exists): pipeline parallelism, DeepCompile, and
    ``zero_optimization.overlap_comm`` below ZeRO stage 2; and what ds_adabatch cannot measure with it: the
    gradient-noise scale at ZeRO stage 0 (``schedule``: the ``"adabatch"`` schedule's config). Empty
    without the key (managed accumulation)."""
    value = ds.get(_MANAGED, True)
    if not isinstance(value, bool):
        return [ConfigProblem(_MANAGED, "must be true or false", value)]
    if value:
        return []
    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    problems = []
    if pipelined:
        problems.append(
            ConfigProblem(
                _MANAGED,
                "DeepSpeed does not support caller-owned accumulation with pipeline parallelism: remove it",
                False,
            )
        )
    if isinstance(zero, dict) and zero.get("overlap_comm") is True and isinstance(stage, int) and stage < 2:
        problems.append(
            ConfigProblem(
                "zero_optimization.overlap_comm",
                f"DeepSpeed's caller-owned accumulation ({_MANAGED}: false) overlaps communication only "
                f"from ZeRO stage 2, and this config has stage {stage}: set overlap_comm to false, raise "
                f"the stage, or remove {_MANAGED}",
                True,
            )
        )
    if stage == 0 and measures_noise(schedule):
        problems.append(
            ConfigProblem(
                _MANAGED,
                f"the {schedule.type} schedule reads the global batch's gradient norm after the step's last "
                "backward, and with caller-owned accumulation ZeRO stage 0 reduces the gradients only "
                f"inside DeepSpeed's step(): remove {_MANAGED}, or use ZeRO stage 1 or more",
                False,
            )
        )
    compile_section = ds.get("compile") or {}
    if isinstance(compile_section, dict) and compile_section.get("deepcompile") is True:
        problems.append(
            ConfigProblem(
                "compile.deepcompile",
                f"DeepSpeed does not support caller-owned accumulation ({_MANAGED}: false) with "
                f"DeepCompile: set compile.deepcompile to false, or remove {_MANAGED}",
                True,
            )
        )
    return problems
