"""``ds_adabatch.initialize``: ``deepspeed.initialize`` with an adaptive global batch."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from ...config import ConfigError, load_ds_config
from ...config.parallel import caller_accumulation_problems
from ...data.loader_setup import build_rank_loader, drop_last_problems
from ...schedules import BatchSizeController
from ...schedules.user import check_schedule_function
from ..core.lr import BatchCoupledLR, CurrentBaseLR
from ..core.weights import make_token_counter, pipeline_token_count
from ..distributed.op_builds import cuda_arch_list_problems, guard_jit_builds
from ..distributed.process_group import init_distributed
from ..engine.data_parallel import AdaptiveBatchEngine
from ..engine.loop import LoopDataLoader
from ..live.recovery import CurrentOptimizer, attach_live_recovery, prepare_live_world
from ..pipeline.engine import AdaptivePipelineEngine
from .arguments import InitializeCall, ModelParameters, OptimizerArgument, SchedulerArgument, resolve_call
from .layout import is_pipeline_module, model_parallel_problems, parallel_layout, pipeline_problems
from .sections import check_deepspeed_sections, untested_optimizer_problems
from .tokens import token_budget_sampler

if TYPE_CHECKING:
    import numpy as np

    from ...config import AdaBatchConfig
    from ...config.loader import LoadedConfig
    from ...config.parallel import ParallelLayout
    from ...data import ElasticDataLoader
    from ...data.token_loader import TokenBudgetLoader
    from ...data.tokens import TokenBudgetSampler

__all__ = ["initialize", "refuse_replaced_deepspeed_initialize"]

logger = logging.getLogger("ds_adabatch")

_REPLACED = (
    "deepspeed.initialize has been replaced by ds_adabatch.initialize: ds_adabatch.initialize builds its "
    "engine with DeepSpeed's own deepspeed.initialize, which it can no longer reach (it would call itself). "
    "Leave deepspeed.initialize as DeepSpeed defines it and call ds_adabatch.initialize(...) where your "
    "script calls deepspeed.initialize; under Hugging Face accelerate, which calls deepspeed.initialize "
    "itself, replace accelerator.prepare(...) with "
    "ds_adabatch.integrations.accelerate.prepare(accelerator, ...) (docs/accelerate.md)"
)
# What ``initialize`` returns: the engine, the optimizer (a handle on the current one under live recovery),
# the loader (the forward / backward / step loop's view of it; None without training data) and the LR
# scheduler coupled to the batch.
Initialized = tuple[
    "AdaptiveBatchEngine | AdaptivePipelineEngine",
    "torch.optim.Optimizer | CurrentOptimizer",
    "LoopDataLoader | ElasticDataLoader | TokenBudgetLoader | None",
    BatchCoupledLR,
]

_calling_deepspeed = False  # inside initialize's own deepspeed.initialize call (a re-entry is a swap)


def initialize(
    *positional: Any,
    args: argparse.Namespace | None = None,
    model: torch.nn.Module | None = None,
    optimizer: OptimizerArgument | None = None,
    model_parameters: ModelParameters | None = None,
    training_data: torch.utils.data.Dataset | None = None,
    lr_scheduler: SchedulerArgument | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: str | os.PathLike | dict | None = None,
    config_params: str | os.PathLike | dict | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    token_count_fn: Callable[[Any], int] | None = None,
    lengths: Sequence[int] | np.ndarray | None = None,
    length_fn: Callable[[Any], int] | None = None,
    **deepspeed_kwargs: Any,
) -> Initialized:
    """Build a DeepSpeed engine whose global batch follows the config's ``"adabatch"`` section.

    Drop-in for ``deepspeed.initialize``: the same keywords, the config found where DeepSpeed finds it,
    and ``(engine, optimizer, dataloader, lr_scheduler)`` returned. Every call form works::

        initialize(args=args, model=net, model_parameters=params, training_data=trainset)  # --deepspeed_config
        initialize(args=args, model=net, model_parameters=params, training_data=trainset, config=ds_config)
        initialize(model=net, config="ds_config.json", training_data=trainset)
        initialize(net, "ds_config.json", trainset, loss_fn=...)       # model, config, training_data
        initialize(args, net, None, params)                            # DeepSpeed's positional order

    The engine is an :class:`AdaptiveBatchEngine`, or for a ``PipelineModule`` an
    :class:`AdaptivePipelineEngine`; plans are made for the data-parallel size either way (the world
    divided by pipeline stages and tensor ranks). With ``training_data`` the returned dataloader hands
    out this rank's micro-batches of the current plan to the forward / backward / step loop
    (:mod:`ds_adabatch.runtime.engine.loop`); ``engine.train_batch()`` takes whole steps from the same stream.

    Args:
        args: like DeepSpeed's: an object (``argparse.Namespace``) whose ``deepspeed_config`` (from
            ``deepspeed.add_config_arguments``; ``--deepspeed_config ds_config.json``) names the config
            when ``config`` does not; its ``local_rank`` is set to this process's, as DeepSpeed does.
        model: the ``torch.nn.Module`` to train, or a DeepSpeed ``PipelineModule`` (build it after
            ``deepspeed.init_distributed()``, as DeepSpeed requires; ZeRO 0 or 1).
        config: path to, or dict of, a full ds_config with an ``"adabatch"`` section (``config_params``
            is its older name, as in DeepSpeed). DeepSpeed's batch keys are filled from the initial plan
            (leave them out, ``"auto"``, or set them to the schedule's start).
        training_data: a map-style dataset (every sample exactly once per epoch, in an order fixed by
            ``adabatch.data.seed``) or an ``IterableDataset`` (each rank draws from its own iterator).
            ``None``: pass micro-batches to ``train_batch(data_iter)`` yourself. A pipeline needs a
            map-style dataset whose ``collate_fn`` returns ``(inputs, labels)``.
        model_parameters, optimizer, lr_scheduler, mpu, dist_init_required: as for
            ``deepspeed.initialize`` (``mpu`` for tensor parallelism).
        collate_fn: turns a list of samples into a micro-batch (default: torch's default collate).
        loss_fn: for ``train_batch``: ``loss_fn(engine, batch) -> Tensor``, the mean loss over the
            micro-batch's samples (or target tokens with ``loss_normalization: "token"``; it may then
            return ``(loss, num_tokens)``, where ``num_tokens`` must equal the count the engine took
            before the forward, from ``labels`` or ``token_count_fn``, else it is refused). Default:
            ``engine(**batch).loss`` (Hugging Face models). For
            a ``PipelineModule``: ``loss_fn(outputs, labels)`` (a function, a ``functools.partial`` or
            a loss module such as ``torch.nn.CrossEntropyLoss()``), the module's own by default; the
            engine weights it (see :class:`~ds_adabatch.runtime.pipeline.feed.WeightedPipelineLoss`).
        token_count_fn: ``token_count_fn(batch) -> int`` target tokens of a micro-batch for
            ``loss_normalization: "token"``; default counts ``labels != -100`` (shifted by one for
            ``*ForCausalLM`` models, whose loss is over shifted labels; unshifted ``labels`` of a
            pipeline's ``(inputs, labels)``).
        lengths: with ``adabatch.micro_batch_tokens``, every sample's length in tokens (a sequence or
            array of ``len(training_data)`` integers), in the unit the budget and a ``unit: "tokens"``
            schedule count; checked against the budget before any process group starts.
        length_fn: instead of ``lengths``, ``length_fn(sample) -> int``, evaluated the first time a
            step reaches the sample and cached (nothing is measured at start-up).
        **deepspeed_kwargs: passed to ``deepspeed.initialize`` (``distributed_port``, ``mesh_param``).

    Raises:
        ConfigError: the ds_config or its ``"adabatch"`` section is invalid, is given twice or not at
            all, or asks for what the parallel layout cannot do — raised before DeepSpeed builds
            anything, and before any process group is created when the problem does not depend on the
            world size.
        TypeError: an argument DeepSpeed would not accept either (named in the message).
        RuntimeError: ``deepspeed.initialize`` was replaced by this function (it would call itself).
    """
    deepspeed_module = sys.modules.get("deepspeed")
    if _calling_deepspeed or deepspeed_module is not None:
        refuse_replaced_deepspeed_initialize(getattr(deepspeed_module, "initialize", None))
    call = resolve_call(
        positional,
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        config=config,
        config_params=config_params,
    )
    builder = _EngineBuilder(
        call,
        loss_fn=loss_fn,
        token_count_fn=token_count_fn,
        lengths=lengths,
        length_fn=length_fn,
        deepspeed_kwargs=deepspeed_kwargs,
    )
    return builder.initialize()


class _EngineBuilder:
    """One ``initialize`` call, checked, with the process group up: builds the engine, and builds it
    again ``into`` the same engine after a live recovery (live/recovery.py calls :meth:`build`)."""

    def __init__(
        self,
        call: InitializeCall,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        token_count_fn: Callable[[Any], int] | None,
        lengths: Sequence[int] | np.ndarray | None,
        length_fn: Callable[[Any], int] | None,
        deepspeed_kwargs: dict[str, Any],
    ) -> None:
        self.call = call
        self.model, self.training_data, self.collate_fn = call.model, call.training_data, call.collate_fn
        self.model_parameters, self.optimizer = call.model_parameters, call.optimizer
        self.lr_scheduler = call.lr_scheduler
        self.loss_fn, self.token_count_fn = loss_fn, token_count_fn
        self.lengths, self.length_fn = lengths, length_fn
        deepspeed_kwargs.update(call.deepspeed_kwargs)
        self.deepspeed_kwargs = deepspeed_kwargs
        loaded = load_ds_config(call.config)
        # DeepSpeed's dataloader_drop_last, where the section leaves drop_last out, as for its own loader.
        self.loaded = honoured = loaded.honouring_deepspeed_drop_last()
        drop_key = "adabatch.data.drop_last" if honoured is loaded else "dataloader_drop_last"
        loaded = honoured
        _check_arguments(
            self.model, self.training_data, loss_fn, self.collate_fn, token_count_fn, deepspeed_kwargs
        )
        self.pipelined = is_pipeline_module(self.model)
        schedule = loaded.adabatch.schedule
        data = self.training_data
        map_style = data is not None and not isinstance(data, torch.utils.data.IterableDataset)
        if map_style and (
            problems := drop_last_problems(
                loaded.adabatch, len(data), drop_last=loaded.adabatch.data.drop_last, drop_last_key=drop_key
            )
        ):
            raise ConfigError(problems, loaded.source)
        if problems := caller_accumulation_problems(
            loaded.deepspeed, pipelined=self.pipelined, schedule=schedule
        ):
            raise ConfigError(problems, loaded.source)
        check_schedule_function(schedule)  # a callable schedule's: importable, callable as configured
        # Lengths are validated (and an over-long sample named) before any process group starts.
        self.token_sampler = token_budget_sampler(loaded.adabatch, self.training_data, lengths, length_fn)

        import deepspeed
        import deepspeed.comm as dist

        self.deepspeed, self.dist = deepspeed, dist
        if not dist.is_initialized():
            check_deepspeed_sections(loaded)
        if problems := untested_optimizer_problems(loaded.deepspeed, self.optimizer):
            raise ConfigError(problems, loaded.source)
        from deepspeed.accelerator import get_accelerator

        if problems := cuda_arch_list_problems(
            loaded.deepspeed, get_accelerator().device_name(), client_optimizer=self.optimizer is not None
        ):
            raise ConfigError(problems, loaded.source)
        self.live = live = loaded.adabatch.live_elastic
        _init_distributed(deepspeed, dist, deepspeed_kwargs, live)
        self.world_live, self.live_off = prepare_live_world(
            live,
            pipelined=self.pipelined,
            mpu=deepspeed_kwargs.get("mpu"),
            training_data=self.training_data,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
        )

    def initialize(self) -> Initialized:
        """The engine, its live recovery armed, and what ``initialize`` returns with it."""
        engine = self.build()
        attach_live_recovery(
            engine, self.live, self.world_live, self.live_off, self.model, lambda: self.build(into=engine)
        )
        loader = engine.dataloader
        if loader is not None and not self.pipelined:
            # The forward / backward / step loop iterates it (loop.py); train_batch reads the same stream.
            loader = LoopDataLoader(engine)
        # With live recovery the DeepSpeed engine (and its optimizer) is rebuilt after a loss: the
        # script's optimizer is then a handle on the current one (live_recovery.py).
        returned = CurrentOptimizer(engine) if engine.live_elastic == "on" else engine.deepspeed.optimizer
        return engine, returned, loader, engine.lr_coupling

    def build(self, into: AdaptiveBatchEngine | None = None) -> AdaptiveBatchEngine | AdaptivePipelineEngine:
        """Everything from the process group on. After a live recovery (live_recovery.py) it runs again
        on the new world ``into`` the engine the script holds, which keeps its LR wrapper and loader."""
        layout, planned = self._plan_world(rounds=into is not None)
        cfg = planned.adabatch
        world, rank = layout.data_parallel_size, layout.data_parallel_rank
        _configure_logging(self.dist.get_rank())
        controller = BatchSizeController(cfg, world_size=world)
        sampler = (
            self.token_sampler
            if into is None
            else token_budget_sampler(cfg, self.training_data, self.lengths, self.length_fn)
        )
        dataloader = _build_loader(cfg, self.training_data, sampler, rank, world, self.collate_fn)
        ds_engine, ds_scheduler = self._deepspeed_engine(planned)
        coupled = _couple_lr(ds_engine, ds_scheduler, planned, controller, into)
        # What the engine derives from the DeepSpeed engine and this world (AdaptiveEngineBase._bind).
        common = {
            "loaded_config": planned,
            "controller": controller,
            "dataloader": dataloader,
            "token_count_fn": self._token_count_fn(cfg, controller),
            "agreement_world": self.dist.get_world_size(),
        }
        if self.pipelined:
            loss_fn = self.loss_fn if self.loss_fn is not None else self.model.loss_fn
            return AdaptivePipelineEngine(ds_engine, lr=coupled, loss_fn=loss_fn, **common)
        data_parallel = {
            "world_size": world,
            # Tensor ranks of a replica hold the same micro-batches: the replica's sums count once.
            "counts_here": layout.tensor_parallel_rank == 0,
            # Tensor-parallel forwards and backwards communicate: passes agree when they begin.
            "model_communicates": layout.tensor_parallel_size > 1,
            **common,
        }
        if into is not None:  # live recovery covers data parallelism only (prepare_live_world)
            into.rebind(ds_engine, **data_parallel)  # its LR wrapper was rebound above (_couple_lr)
            return into
        return AdaptiveBatchEngine(ds_engine, lr=coupled, loss_fn=self.loss_fn, **data_parallel)

    def _plan_world(self, *, rounds: bool) -> tuple[ParallelLayout, LoadedConfig]:
        """The parallel layout of this world (checked) and the config planned for its data-parallel size.

        ``rounds``: the survivors of a live recovery plan a schedule batch that is not plannable on their
        world by rounding it, as the controller rounds every batch, rather than refusing the config a
        start refuses (``LoadedConfig.with_world_size``)."""
        model, loaded, dist = self.model, self.loaded, self.dist
        layout = parallel_layout(
            model, self.deepspeed_kwargs.get("mpu"), dist.get_world_size(), dist.get_rank()
        )
        if self.pipelined:
            pipeline_problems(model, loaded, self.training_data, self.loss_fn, self.deepspeed_kwargs, layout)
        else:
            problems = model_parallel_problems(loaded, layout)
            if problems:
                raise ConfigError(problems, loaded.source)
        return layout, loaded.with_world_size(layout.data_parallel_size, rounds=rounds)

    def _deepspeed_engine(self, planned: LoadedConfig) -> tuple[Any, Any]:
        """DeepSpeed's engine and LR scheduler for the planned config (an optimizer is required)."""
        if self.world_live is not None:
            self.world_live.seed_deepspeed_group()  # before DeepSpeed clones the world (live_world.py)
        model, model_parameters = self.model, self.model_parameters
        ds_engine, _, _, ds_scheduler = _deepspeed_initialize(
            self.deepspeed,
            args=self.call.deepspeed_args,
            model=model,
            model_parameters=model_parameters if model_parameters is not None else model.parameters(),
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            config=planned.deepspeed,
            **self.deepspeed_kwargs,
        )
        self.call.report_local_rank(ds_engine.local_rank)
        if ds_engine.optimizer is None:
            raise ConfigError.single(
                "optimizer",
                'training needs an optimizer: add an "optimizer" section or pass optimizer=',
                None,
            )
        return ds_engine, ds_scheduler

    def _token_count_fn(
        self, cfg: AdaBatchConfig, controller: BatchSizeController
    ) -> Callable[[Any], int] | None:
        """The target-token counter: the user's, or a default where the run counts tokens."""
        # Token-budget steps count the clock's tokens from the lengths; only a token loss needs a counter.
        keyed_on_tokens = "tokens" in controller.schedule.requires and not cfg.token_budget
        needs_tokens = cfg.loss_normalization == "token" or keyed_on_tokens
        if needs_tokens and self.token_count_fn is None:
            return pipeline_token_count if self.pipelined else make_token_counter(self.model)
        return self.token_count_fn


def _couple_lr(
    ds_engine: Any,
    ds_scheduler: Any,
    planned: LoadedConfig,
    controller: BatchSizeController,
    into: AdaptiveBatchEngine | None,
) -> BatchCoupledLR:
    """The LR coupling on DeepSpeed's optimizer and scheduler: new, or the engine's rebound (a rebuild)."""
    cfg = planned.adabatch
    reference = cfg.lr_scaling.reference_batch or planned.plan.global_batch_size
    if into is None:
        coupled = BatchCoupledLR(
            ds_engine.optimizer,
            ds_scheduler,
            unit=cfg.lr_schedule_unit,
            reference_batch=reference,
            rule=cfg.lr_scaling.rule,
            gain_power=cfg.lr_scaling.gain_power,
        )
    else:
        coupled = into.lr_coupling
        coupled.rebind(ds_engine.optimizer, ds_scheduler, reference_batch=reference)
    # DeepSpeed 0.19.8 steps engine.lr_scheduler once per applied optimizer step and checkpoints its
    # state_dict; the coupled wrapper takes that slot so both go through it.
    ds_engine.lr_scheduler = coupled
    bind = getattr(controller.schedule, "bind_base_lr", None)
    if callable(bind):  # LR-aware schedules (seesaw) read the scheduler's unscaled LR
        bind(CurrentBaseLR(coupled))
    return coupled


def refuse_replaced_deepspeed_initialize(current: Any) -> None:
    """Raise the sentence that points to the way in when ``deepspeed.initialize`` is this function (or a
    wrapper that called back into it: ``initialize`` was entered from its own DeepSpeed call)."""
    if _calling_deepspeed or current is initialize:
        raise RuntimeError(_REPLACED)


def _deepspeed_initialize(deepspeed: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    global _calling_deepspeed
    refuse_replaced_deepspeed_initialize(deepspeed.initialize)
    _calling_deepspeed = True
    try:
        return deepspeed.initialize(**kwargs)
    finally:
        _calling_deepspeed = False


def _build_loader(
    cfg: AdaBatchConfig,
    training_data: Any,
    token_sampler: TokenBudgetSampler | None,
    rank: int,
    world: int,
    collate_fn: Callable | None,
) -> ElasticDataLoader | TokenBudgetLoader | None:
    """This data-parallel rank's loader (every process of a replica builds the same one)."""
    return build_rank_loader(
        training_data,
        cfg.data,
        token_sampler=token_sampler,
        rank=rank,
        world_size=world,
        collate_fn=collate_fn,
    )


def _check_arguments(model, training_data, loss_fn, collate_fn, token_count_fn, deepspeed_kwargs) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, fn in (("loss_fn", loss_fn), ("collate_fn", collate_fn), ("token_count_fn", token_count_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    if training_data is not None and not isinstance(training_data, torch.utils.data.IterableDataset):
        if not (hasattr(training_data, "__len__") and hasattr(training_data, "__getitem__")):
            raise TypeError(
                "training_data must be a map-style dataset (with __len__ and __getitem__) or a "
                f"torch.utils.data.IterableDataset, got {type(training_data).__name__}"
            )
        if len(training_data) == 0:
            raise ValueError("training_data is empty")


def _init_distributed(deepspeed, dist, kwargs, live) -> None:
    guard_jit_builds()  # the optimizer's op (FusedAdam, CPUAdam) is JIT-built in deepspeed.initialize
    if kwargs.get("dist_init_required", True) is False:
        return
    # Restart-safe under torchrun --max-restarts, a world of one without a launcher (process_group.py).
    # A group the script formed (deepspeed.init_distributed() included) is kept; the call then only
    # removes the /dev/shm name of DeepSpeed's CPU all-reduce buffer.
    # A live-elastic job bounds every collective by its timeout (a hung peer counts as lost after it).
    init_distributed(timeout=timedelta(seconds=live.collective_timeout_s) if live.enabled else None)


def _configure_logging(rank: int) -> None:
    # Plan-change lines are INFO on rank 0; give the logger a handler unless the user configured one.
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[ds_adabatch] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
