"""``prepare(accelerator, *objects)``: ``accelerator.prepare`` with the engine built by ds_adabatch.

accelerate 1.15 (``Accelerator._prepare_deepspeed``) fills DeepSpeed's ``"auto"`` keys, builds its
optimizer and scheduler wrappers, registers the engine for ``save_state`` / ``load_state`` and then calls
``deepspeed.initialize`` — looked up on the module at that moment. :func:`prepare` lets accelerate do all
of that and takes the place of ``deepspeed.initialize`` for the one call (and restores it first thing, so
the DeepSpeed engine inside is built by DeepSpeed's own function): the engine comes from
:func:`ds_adabatch.initialize`, over the training loader's dataset and collate function.

What accelerate would take from the loaders — DeepSpeed's batch keys, filled from the smaller of the
train and eval loaders' ``batch_size`` — belongs to the plan here: keys that are ``"auto"`` or absent in
accelerate's config are given the initial plan's values (so accelerate reads nothing from the loaders)
and left out of the config :func:`ds_adabatch.initialize` reads; keys the user wrote as numbers are
checked against the plan as ``initialize`` always does. The training loader is not shown to accelerate at
all: its slot in the result holds ds_adabatch's loader (:mod:`.loop`); every other object, the eval
loader included, is accelerate's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ...config import ConfigError, load_ds_config
from ...config.loader import BATCH_KEYS, SECTION
from ...runtime.initialize.build import initialize, refuse_replaced_deepspeed_initialize
from .loop import AdaptiveTrainDataLoader, PlanBackward, StepsAsAccelerate, skip_nothing, unwrap_through

if TYPE_CHECKING:  # pragma: no cover
    from accelerate import Accelerator

    from ds_adabatch import AdaptiveBatchEngine

__all__ = ["prepare"]

_NOT_DEEPSPEED = (
    "ds_adabatch.integrations.accelerate.prepare() needs accelerate's DeepSpeed plugin (`accelerate launch "
    "--use_deepspeed --deepspeed_config_file ds_config.json`, or Accelerator(deepspeed_plugin=...)); this "
    "Accelerator runs {kind}. Plain DDP has no DeepSpeed engine for the plan to drive: use the DeepSpeed "
    "plugin with ZeRO stage 0 for plain data parallelism, or the Hugging Face Trainer integration"
)


class _TrainLoaderSlot:
    """Stands where the training loader was while accelerate prepares the rest (it returns it as is)."""


def prepare(accelerator: Accelerator, *objects: Any) -> Any:
    """``accelerator.prepare(*objects)`` with the engine built by :func:`ds_adabatch.initialize`.

    The same call and the same return as ``accelerator.prepare``: the objects in the caller's order —
    the model becomes the engine, the optimizer and LR scheduler accelerate's DeepSpeed wrappers, the
    eval dataloader accelerate's — except that the **first** ``torch.utils.data.DataLoader`` (the training
    loader) is replaced by ds_adabatch's: it hands out this rank's micro-batches of the current plan,
    drawn from that loader's ``dataset`` with its ``collate_fn`` (its ``batch_size``, sampler and
    ``shuffle`` give way to the section's plan and ``data`` settings).

    The ``"adabatch"`` section is read from accelerate's DeepSpeed config
    (``accelerator.state.deepspeed_plugin.deepspeed_config``, i.e. the ``--deepspeed_config_file``).

    Raises:
        ConfigError: no ``"adabatch"`` section, or the section / DeepSpeed's batch keys are invalid.
        TypeError: no training ``DataLoader`` or no model among ``objects``.
        RuntimeError: the accelerator does not use DeepSpeed, or ``deepspeed.initialize`` was replaced by
            ``ds_adabatch.initialize``.
    """
    import deepspeed
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise RuntimeError(_NOT_DEEPSPEED.format(kind=accelerator.distributed_type))
    refuse_replaced_deepspeed_initialize(deepspeed.initialize)
    slot = _train_loader_index(objects)
    train_loader = objects[slot]
    if not any(isinstance(obj, torch.nn.Module) for obj in objects):
        raise TypeError(
            "prepare() needs the model among the objects (one torch.nn.Module), as DeepSpeed does"
        )

    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    section = ds_config.get(SECTION)
    if section is None:
        raise ConfigError.single(
            SECTION,
            'accelerate\'s DeepSpeed config has no "adabatch" section: add it to the file given as '
            "--deepspeed_config_file (or to DeepSpeedPlugin(hf_ds_config=...))",
        )
    # Keys that accelerate would fill from the loaders' batch sizes (or its own gradient_accumulation_steps).
    filled = [key for key in BATCH_KEYS if ds_config.get(key, "auto") == "auto"]
    given = {key: value for key, value in ds_config.items() if key not in filled}
    loaded = load_ds_config(given, world_size=_world_size())  # the section, checked before anything is built
    built: dict[str, Any] = {}
    saved = {key: ds_config.get(key) for key in filled}
    del ds_config[SECTION]  # accelerate would read the section's "auto" values as its own to fill
    for key in filled:
        ds_config[key] = loaded.deepspeed[key]  # accelerate then takes no batch size from the loaders
    build = _builder(accelerator, objects, train_loader, section, filled, built)
    real_initialize = deepspeed.initialize
    deepspeed.initialize = build
    try:
        shown = [_TrainLoaderSlot() if i == slot else obj for i, obj in enumerate(objects)]
        result = list(accelerator.prepare(*shown))
    finally:
        deepspeed.initialize = real_initialize
        ds_config[SECTION] = section
        if "engine" not in built:  # accelerate failed before building: its config is as it was
            for key, value in saved.items():
                if value is None:
                    ds_config.pop(key, None)
                else:
                    ds_config[key] = value
    engine = built["engine"]
    loader = AdaptiveTrainDataLoader(accelerator, engine, built["loader"], train_loader.dataset)
    result[slot] = loader
    _attach(accelerator, engine, loader)
    return result[0] if len(result) == 1 else tuple(result)


def _train_loader_index(objects: tuple[Any, ...]) -> int:
    for i, obj in enumerate(objects):
        if isinstance(obj, torch.utils.data.DataLoader):
            return i
    raise TypeError(
        "prepare() needs the training torch.utils.data.DataLoader among the objects (the first DataLoader "
        "is the training one): ds_adabatch draws the plan's micro-batches from its dataset and collate_fn"
    )


def _world_size() -> int:
    import deepspeed.comm as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _builder(
    accelerator: Accelerator,
    objects: tuple[Any, ...],
    train_loader: torch.utils.data.DataLoader,
    section: Any,
    filled: list[str],
    built: dict[str, Any],
) -> Callable[..., tuple[Any, Any, Any, Any]]:
    """What accelerate calls as ``deepspeed.initialize(**kwargs)``: ``ds_adabatch.initialize`` instead."""
    import deepspeed

    real_initialize = deepspeed.initialize

    def build(**kwargs: Any) -> tuple[Any, Any, Any, Any]:
        deepspeed.initialize = real_initialize  # ds_adabatch.initialize calls DeepSpeed's own inside
        config = dict(kwargs.pop("config_params", None) or kwargs.pop("config"))
        for key in filled:
            config.pop(key, None)  # the plan fills them
        config[SECTION] = section
        lr_scheduler = kwargs.pop("lr_scheduler", None)
        if lr_scheduler is None:
            lr_scheduler = _client_scheduler(accelerator, objects, section)
        engine, optimizer, loader, coupled = initialize(
            config=config,
            training_data=train_loader.dataset,
            collate_fn=train_loader.collate_fn,
            lr_scheduler=lr_scheduler,
            **kwargs,
        )
        built.update(engine=engine, loader=loader)
        # accelerate wraps a returned scheduler in DeepSpeedSchedulerWrapper (its step() is a no-op) and
        # DeepSpeed steps it inside engine.step(): the coupled scheduler, once per optimizer step.
        return engine, optimizer, None, coupled

    return build


def _client_scheduler(
    accelerator: Accelerator, objects: tuple[Any, ...], section: object
) -> torch.optim.lr_scheduler.LRScheduler | StepsAsAccelerate | None:
    """The user's torch LR scheduler, handed to DeepSpeed so the batch coupling wraps it.

    accelerate keeps a torch scheduler outside DeepSpeed (``AcceleratedScheduler``), stepping it
    ``num_processes`` times per optimizer step unless ``split_batches``; with ``lr_schedule_unit:
    "steps"`` it is stepped the same way here (``StepsAsAccelerate``), so a schedule written for
    accelerate keeps its length.
    """
    schedulers = [obj for obj in objects if isinstance(obj, torch.optim.lr_scheduler.LRScheduler)]
    if not schedulers:
        return None
    scheduler = schedulers[0]
    unit = section.get("lr_schedule_unit", "steps") if isinstance(section, dict) else "steps"
    times = 1 if accelerator.split_batches else accelerator.num_processes
    if unit == "steps" and times > 1:
        return StepsAsAccelerate(scheduler, times)
    return scheduler


def _attach(accelerator: Accelerator, engine: AdaptiveBatchEngine, loader: AdaptiveTrainDataLoader) -> None:
    """Point accelerate's backward at the plan and make its ``no_sync`` / ``skip_first_batches`` fit."""
    # accelerate 1.15 Accelerator.backward calls self.deepspeed_engine_wrapped.backward(loss,
    # sync_gradients=...); its DeepSpeedEngineWrapper sets the boundary from sync_gradients and steps
    # only there. PlanBackward takes the boundary from the plan and weights the micro-batch.
    accelerator.deepspeed_engine_wrapped = PlanBackward(engine, accelerator)
    # accelerate 1.15 Accelerator.no_sync enters model.no_sync() off the boundary under ZeRO 0/1;
    # DeepSpeed 0.19.8 DeepSpeedEngine.no_sync forbids engine.step() inside, which every micro-batch of
    # the plan runs. DeepSpeed reduces gradients only at the boundary set explicitly for every
    # micro-batch, so no_sync has nothing left to save: it is a no-op on this engine.
    engine.no_sync = _no_sync
    # load_state puts the loader at the saved step; skip_first_batches must not skip again.
    accelerator.skip_first_batches = skip_nothing(loader, accelerator.skip_first_batches)
    # accelerate 1.15 extract_model_from_parallel unwraps a DeepSpeedEngine by type; the engine here
    # holds one (engine.deepspeed). Unwrapping it gives the user's model back, for unwrap_model and for
    # get_state_dict (which unwraps through the instance's unwrap_model).
    accelerator.unwrap_model = unwrap_through(engine, accelerator.unwrap_model)


def _no_sync() -> Any:
    import contextlib

    return contextlib.nullcontext()
