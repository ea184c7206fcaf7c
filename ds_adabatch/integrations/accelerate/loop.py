"""The training loop accelerate's examples write, on ds_adabatch's plan.

Three pieces, each standing where accelerate 1.15 has its own:

* :class:`AdaptiveTrainDataLoader` — in place of accelerate's ``DataLoaderShard``: iterates the engine's
  forward / backward / step loop loader (:mod:`ds_adabatch.runtime.engine.loop`), moves each micro-batch to the
  engine's device, and before handing it out tells accelerate's ``GradientState`` where the plan's
  boundary is: ``end_of_dataloader`` is true on the step's last micro-batch and ``num_steps`` is the
  step's micro-batch count, so ``accelerator.accumulate()`` (``Accelerator._do_sync``) sets
  ``accelerator.sync_gradients`` exactly on the plan's last micro-batch — also when GAS changes.
* :class:`PlanBackward` — in place of accelerate's ``DeepSpeedEngineWrapper``: ``accelerator.backward(loss)``
  runs the engine's weighted backward and its step (DeepSpeed's micro-step, the optimizer step after
  the plan's last micro-batch), after checking that accelerate's ``sync_gradients`` agrees with the plan.
* :class:`StepsAsAccelerate` — a torch LR scheduler stepped as accelerate's ``AcceleratedScheduler``
  steps it (``num_processes`` times per optimizer step), through the batch coupling.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from accelerate import Accelerator

    from ds_adabatch import AdaptiveBatchEngine

__all__ = ["AdaptiveTrainDataLoader", "PlanBackward", "StepsAsAccelerate", "skip_nothing", "unwrap_through"]


class AdaptiveTrainDataLoader:
    """The training loader :func:`~ds_adabatch.integrations.accelerate.prepare` returns.

    ``for batch in loader`` is one epoch of this rank's micro-batches of the current plan (every sample
    once per epoch); ``len(loader)`` counts the micro-batches left in the epoch if the current plan held.
    Anything else (``state_dict``, ``sampler``, ...) is the engine's loader.
    """

    # Class defaults: __getattr__ (the engine's loader) never runs for these names.
    accelerator: Accelerator | None = None
    engine: AdaptiveBatchEngine | None = None
    loop_loader: Any = None
    dataset: Any = None
    end_of_dataloader = False

    def __init__(
        self, accelerator: Accelerator, engine: AdaptiveBatchEngine, loop_loader: Any, dataset: Any
    ) -> None:
        self.accelerator, self.engine, self.loop_loader, self.dataset = (
            accelerator,
            engine,
            loop_loader,
            dataset,
        )

    # accelerate 1.15 GradientState reads these of the active dataloader (gather_for_metrics, _do_sync).
    @property
    def remainder(self) -> int:
        return -1  # no sample is duplicated to even out the ranks: nothing to drop in gather_for_metrics

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.loop_loader, name)

    def __len__(self) -> int:
        return len(self.loop_loader)

    def __iter__(self) -> Iterator[Any]:
        state = self.accelerator.gradient_state
        # accelerate 1.15 GradientState._add_dataloader / _remove_dataloader (private): what its own
        # DataLoaderShard.begin() / end() call, so end_of_dataloader is read from this loader.
        state._remove_dataloader(self)
        state._add_dataloader(self)
        try:
            for batch in self.loop_loader:
                self._mark_boundary()
                yield _to_device(batch, self.engine.device)
        finally:
            self.end_of_dataloader = False
            state._remove_dataloader(self)

    def _mark_boundary(self) -> None:
        """Make accelerate's next ``accumulate()`` say ``sync_gradients`` exactly on the plan's boundary."""
        loop = self.engine.loop.in_progress  # the step in progress (runtime/engine/loop.py): its
        # micro-batch just handed out
        index, count = loop.current, len(loop.micro)
        last = index == loop.last
        accelerator, state = self.accelerator, self.accelerator.gradient_state
        self.end_of_dataloader = last
        # accelerate 1.15 Accelerator._do_sync: end_of_dataloader -> sync and step = 0; otherwise
        # step += 1 and sync when step % num_steps == 0. With step = index and num_steps = the plan's
        # micro-batches per step, index + 1 < num_steps off the boundary: never a sync there.
        state.plugin_kwargs["num_steps"] = count
        accelerator.step = index
        # Also right for a loop without accumulate() (accelerate 1.15 GradientState._set_sync_gradients).
        state._set_sync_gradients(last)

    def __repr__(self) -> str:
        return f"AdaptiveTrainDataLoader({self.loop_loader!r})"


class PlanBackward:
    """``accelerator.backward(loss)`` on the plan (accelerate 1.15 calls ``backward(loss, sync_gradients,
    **kwargs)`` and ``get_global_grad_norm()`` of ``accelerator.deepspeed_engine_wrapped``)."""

    def __init__(self, engine: AdaptiveBatchEngine, accelerator: Accelerator) -> None:
        self.engine = engine
        self.accelerator = accelerator

    def backward(self, loss: torch.Tensor, sync_gradients: bool = True, **kwargs: Any) -> None:
        engine = self.engine
        loop = engine.loop.in_progress
        if loop is None or loop.current is None:
            raise RuntimeError(
                "accelerator.backward() needs a micro-batch from the training dataloader that "
                "ds_adabatch.integrations.accelerate.prepare() returned (the plan weights each of its "
                "micro-batches); a batch of another DataLoader has the size of no plan. Iterate "
                "`for batch in train_dataloader:` as returned by prepare()"
            )
        boundary = loop.current == loop.last
        if bool(sync_gradients) != boundary:
            raise RuntimeError(
                f"accelerator.sync_gradients is {bool(sync_gradients)} but micro-batch {loop.current} of "
                f"{len(loop.micro)} in this optimizer step {'ends' if boundary else 'does not end'} it: "
                "the training dataloader sets sync_gradients from the plan; do not set "
                "accelerator.sync_gradients or gradient_accumulation_steps yourself"
            )
        kwargs.pop("scale_wrt_gas", None)  # the plan's weight replaces DeepSpeed's 1 / GAS
        engine.backward(loss, **kwargs)
        engine.step()  # DeepSpeed's micro-step; after the plan's last micro-batch, the optimizer step

    def get_global_grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        return norm.item() if hasattr(norm, "item") else norm


class StepsAsAccelerate:
    """A torch LR scheduler stepped ``times`` times per call, as accelerate 1.15's ``AcceleratedScheduler``
    steps one it wraps (``num_processes`` times per optimizer step unless ``split_batches``; a scheduler
    with ``total_steps`` is not stepped past them)."""

    scheduler: torch.optim.lr_scheduler.LRScheduler | None = (
        None  # a class default: __getattr__ never runs for it
    )

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, times: int) -> None:
        self.scheduler = scheduler
        self.times = times

    def step(self, *args: Any, **kwargs: Any) -> None:
        scheduler = self.scheduler
        for _ in range(self.times):
            total = getattr(scheduler, "total_steps", None)
            if total is not None and scheduler._step_count > total:  # torch's OneCycleLR counter
                return
            scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)


def skip_nothing(loader: AdaptiveTrainDataLoader, original: Callable[..., Any]) -> Callable[..., Any]:
    """``accelerator.skip_first_batches`` that returns ds_adabatch's loader as it is.

    ``accelerator.load_state`` already put it at the saved optimizer step (the sample cursor is in the
    checkpoint), and a count of batches means nothing when their size changes. Other loaders are
    accelerate's business.
    """

    @functools.wraps(original)
    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        if dataloader is loader:
            return loader
        return original(dataloader, num_batches)

    return skip_first_batches


def unwrap_through(engine: AdaptiveBatchEngine, original: Callable[..., Any]) -> Callable[..., Any]:
    """``accelerator.unwrap_model`` that unwraps ds_adabatch's engine as accelerate unwraps DeepSpeed's."""

    @functools.wraps(original)
    def unwrap_model(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return original(engine.deepspeed if model is engine else model, *args, **kwargs)

    return unwrap_model


def _to_device(batch: Any, device: torch.device) -> Any:
    from accelerate.utils import send_to_device

    return send_to_device(batch, device)
