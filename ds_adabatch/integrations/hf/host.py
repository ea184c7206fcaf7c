"""What the parts of the Trainer integration read from the Trainer that holds them.

:class:`~ds_adabatch.integrations.hf.step.TrainerStep` and the release adapters of ``hf.compat`` are
held by ``AdaptiveBatchSizeTrainer`` and call back into it (its model, accelerator and loss, as a
``transformers.Trainer`` has them, and the run's batch state). :class:`TrainerHost` writes that
contract down for type checkers; nothing here imports transformers at run time.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from accelerate import Accelerator
    from transformers import TrainerState, TrainingArguments

    from ds_adabatch.runtime.core.lr import BatchCoupledLR

    from .metrics import TrainerStepLog
    from .state import AdaptiveBatchState

__all__ = ["TrainerHost"]


class TrainerHost(Protocol):
    """The ``AdaptiveBatchSizeTrainer`` its held parts see (``transformers.Trainer`` attributes and the
    integration's own)."""

    args: TrainingArguments
    state: TrainerState
    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    model_accepts_loss_kwargs: bool
    compute_loss_func: Any
    is_deepspeed_enabled: bool
    is_in_train: bool
    batch_state: AdaptiveBatchState | None
    _lr_coupling: BatchCoupledLR | None
    _step_log: TrainerStepLog | None
    _auto_warmup: bool
    _resume_path: str | None

    def _require_state(self) -> AdaptiveBatchState: ...

    def _prepare_inputs(self, inputs: Any) -> Any: ...

    def compute_loss(self, model: torch.nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any: ...

    def compute_loss_context_manager(self) -> AbstractContextManager[Any]: ...

    def get_tp_size(self) -> int: ...

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any: ...

    def _training_values(self, args: TrainingArguments) -> tuple[Any, ...]: ...

    def _resume_batch_state(self, resume_from_checkpoint: Any) -> int: ...

    def _align_trainer_state(self, max_steps: int) -> None: ...

    def _start_step_log(self) -> None: ...

    def _show_first_gas(self) -> None: ...
