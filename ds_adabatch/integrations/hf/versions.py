"""The transformers and accelerate releases ``AdaptiveBatchSizeTrainer`` runs on, checked at construction.

Why the floor is transformers 5.18.0:

* The integration keeps the Trainer's outer loop and replaces the inside of one optimizer step, through
  methods the loop calls. Before 5.3.0 the loop was one function (``_inner_training_loop``) that never
  called several of them (``set_initial_training_values`` took a third argument; ``_init_training_state``
  and ``_prepare_for_training`` did not exist): on 4.x and 5.0–5.2 the first ``train()`` failed inside
  transformers, and patching that would have left a run that exits 0 without its step records.
* 5.3–5.17 fill a DeepSpeed scheduler's ``"auto"`` ``warmup_num_steps`` with 0 when ``TrainingArguments``
  has no warmup, which deepspeed 0.19.8 refuses (5.18 fills ``max(1, steps)``), and resume a
  multi-process CPU run's optimizer with ``map_location=args.device``, which torch cannot restore under
  accelerate 1.15 (``cpu:0``); the plain ``Trainer`` fails the same two ways there. Tried on 5.3.0: every
  DeepSpeed and single-process path of the test suite passed, those two did not.

The integration is tested on 5.18.0 and on the newest release (CI runs the Trainer tests on both:
``scripts/test_hf_floor.sh``). Anything outside :data:`TRANSFORMERS` / :data:`ACCELERATE` is refused when
the trainer is built, with one sentence, before any process group starts.

The transformers methods the integration overrides that are not public API, each checked against 5.18.0
and 5.24.0 (same signatures and call sites in both; 5.3.0 too):

=================================  ======================================================================
``set_initial_training_values``    ``(args, dataloader)``: steps per epoch and of the run, from the schedule
``_init_training_state``           the resumed epoch/step counters (the sample cursor is ours)
``_prepare_for_training``          ``(max_steps, train_dataloader, resume_from_checkpoint)``; the banner's GAS
``get_batch_samples``              ``(epoch_iterator, num_batches, device)``: one item = one optimizer step
``training_step``                  ``(model, inputs, num_items_in_batch)``: the step's weighted passes
``_save_checkpoint``               ``(model, trial)``: ``adabatch_state.json`` beside ``trainer_state.json``
``_maybe_log_save_evaluate``       resolves pending step records before logging
``_track_num_input_tokens``        the tokens of the step's passes
=================================  ======================================================================

``TrainingArguments.dataloader_multiprocessing_context`` is read where it exists.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ACCELERATE", "TRANSFORMERS", "check_versions", "installed"]

TRANSFORMERS = ("5.18.0", "6")
"""``[low, high)``: the transformers releases the integration runs on (5.18.0 and the newest, tested)."""
ACCELERATE = ("1.15.0", "2")
"""``[low, high)``: the accelerate releases it runs on (1.15, tested with both transformers ends)."""


def _version(text: str) -> Any:
    from packaging.version import Version

    return Version(text)


def installed(package: str) -> str:
    """The installed release of ``package`` (its distribution's metadata)."""
    from importlib.metadata import version

    return version(package)


def _outside(found: str, bounds: tuple[str, str]) -> bool:
    version = _version(found)
    return not (_version(bounds[0]) <= version < _version(bounds[1]))


def check_versions(transformers_version: str | None = None, accelerate_version: str | None = None) -> None:
    """Raise ``RuntimeError`` with one sentence when transformers or accelerate is outside the range
    the integration runs on (the installed versions unless given)."""
    if transformers_version is None:
        transformers_version = installed("transformers")
    if accelerate_version is None:
        accelerate_version = installed("accelerate")
    problems = []
    if _outside(transformers_version, TRANSFORMERS):
        problems.append(
            f"transformers {transformers_version} is installed and AdaptiveBatchSizeTrainer runs on "
            f"transformers >= {TRANSFORMERS[0]}, < {TRANSFORMERS[1]} (the Trainer loop it plugs into, and "
            f'DeepSpeed configs that deepspeed 0.19.8 accepts): pip install "transformers>={TRANSFORMERS[0]},<{TRANSFORMERS[1]}"'
        )
    if _outside(accelerate_version, ACCELERATE):
        problems.append(
            f"accelerate {accelerate_version} is installed and AdaptiveBatchSizeTrainer is tested with "
            f'accelerate >= {ACCELERATE[0]}, < {ACCELERATE[1]}: pip install "accelerate>={ACCELERATE[0]},'
            f'<{ACCELERATE[1]}"'
        )
    if problems:
        raise RuntimeError("; ".join(problems))
