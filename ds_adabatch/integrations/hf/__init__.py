"""The Hugging Face ``Trainer`` integration: :class:`AdaptiveBatchSizeTrainer` and the parts it is built from.

Public names (``__all__``) resolve when first touched, so importing this package, or one of its modules
that does not need transformers (``config``, ``lengths``, ``state``, ...), does not import transformers.
``hf.trainer``'s docstring describes the design as a whole.

Which module does what:

* ``trainer``: the ``AdaptiveBatchSizeTrainer`` class, a ``transformers.Trainer`` subclass whose overrides
  call into the modules below.
* ``prepare``: builds a run's batch state from ``TrainingArguments``, the scheduler and the section.
* ``config``: reads and checks the ``"adabatch"`` section (``adabatch_config=`` or the DeepSpeed config).
* ``state``: ``AdaptiveBatchState``, the batch side of a run (schedule, plan, sample stream, checkpoint).
* ``progress``: how long a run is (epochs, optimizer steps, LR schedule length) and the run summary.
* ``data``: the loader the Trainer's loop iterates, one item per optimizer step.
* ``step``: ``TrainerStep``, one optimizer step, every micro-batch of this rank weighted exactly (held by
  the trainer; its ``training_step`` hands each step to it).
* ``engine``: what a step does to DeepSpeed, the LR scheduler and the loss function.
* ``callback``: the Trainer callback that keeps epoch, step budget and progress bar true to the stream.
* ``metrics``: the per-step ``adabatch.log`` records.
* ``logs``: routes the ``ds_adabatch`` logger through transformers' logging while training runs.
* ``lengths``: each training sample's length in tokens, for token-budget steps.
* ``dist``: makes the launched ranks one data-parallel group and checks the process layout.
* ``versions``: the transformers and accelerate releases supported, checked at construction.
* ``compat``: the release adapters the trainer holds: how it reaches the one-function training loop of
  4.57.6 and 5.0-5.2, and the plain Trainer's fixes before 5.18.
* ``host``: what the held parts read from the trainer (a ``Protocol``, for type checkers).

``trainer`` imports the other modules and none of them imports ``trainer`` back: there is no import
cycle among them (``tests/test_import_graph.py`` checks it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .state import STATE_FILE, AdaptiveBatchState
    from .trainer import AdaptiveBatchSizeTrainer, BatchSizeScheduler

__all__ = ["STATE_FILE", "AdaptiveBatchSizeTrainer", "AdaptiveBatchState", "BatchSizeScheduler"]


def __getattr__(name: str):
    # The state names need no transformers; the trainer's import it.
    if name in ("AdaptiveBatchState", "STATE_FILE"):
        from . import state as home
    elif name in ("AdaptiveBatchSizeTrainer", "BatchSizeScheduler"):
        from . import trainer as home
    else:
        raise AttributeError(f"module 'ds_adabatch.integrations.hf' has no attribute {name!r}")
    value = getattr(home, name)
    globals()[name] = value
    return value
