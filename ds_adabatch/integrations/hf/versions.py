"""The transformers and accelerate releases ``AdaptiveBatchSizeTrainer`` runs on, checked at construction.

Accepted: transformers 4.57.6 (the last 4.x; ``hf.compat`` plugs into its one-function loop) and 5.18.0
up to the newest 5.x, with accelerate 1.15+. CI runs the Trainer tests on 4.57.6
(``scripts/test_hf_floor.sh``) and on the newest release.

Refused, and why:

* 4.x before 4.57.6: not tested (the field's 4.x stacks pin 4.57.x; 4.57.6 is its last patch release).
* 5.0-5.2: not tested. Their loop is the one-function loop of 4.x with changes around it that
  ``hf.compat`` has not been checked against.
* 5.3-5.17 fill a DeepSpeed scheduler's ``"auto"`` ``warmup_num_steps`` with 0 when ``TrainingArguments``
  has no warmup, which deepspeed 0.19.8 refuses (5.18 fills ``max(1, steps)``), and resume a
  multi-process CPU run's optimizer with ``map_location=args.device``, which torch cannot restore under
  accelerate 1.15 (``cpu:0``); the plain ``Trainer`` fails the same two ways there. Tried on 5.3.0: every
  DeepSpeed and single-process path of the test suite passed, those two did not. 4.57 has the same two
  faults; ``hf.compat`` works around them in 4.57's loop, and is not wired into 5.3-5.17's.

Anything outside :data:`TRANSFORMERS` / :data:`ACCELERATE` is refused when the trainer is built, with one
sentence, before any process group starts; ``setup.py`` states the same (:data:`REQUIREMENT`).

The transformers methods the integration overrides that are not public API, each checked against 5.18.0
and 5.24.0 (same signatures and call sites in both; 5.3.0 too); 4.57.6 reaches the same steps through
other methods (``hf.compat``):

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

__all__ = ["ACCELERATE", "REQUIREMENT", "TRANSFORMERS", "check_versions", "installed", "legacy_loop"]

TRANSFORMERS: tuple[tuple[str, str], ...] = (("4.57.6", "5"), ("5.18.0", "6"))
"""``[low, high)`` ranges: the transformers releases the integration runs on (4.57.6, 5.18.0 and the
newest, tested)."""
REQUIREMENT = "transformers>=4.57.6,<6," + ",".join(f"!=5.{minor}.*" for minor in range(18))
"""The same ranges as a pip requirement (``setup.py``'s ``hf`` and ``dev`` extras)."""
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


def _accepted() -> str:
    return " or ".join(f">= {low}, < {high}" for low, high in TRANSFORMERS)


def legacy_loop(transformers_version: str | None = None) -> bool:
    """Whether transformers (the installed release unless given) has 4.x's one-function training loop."""
    found = installed("transformers") if transformers_version is None else transformers_version
    return _version(found) < _version("5")


def check_versions(transformers_version: str | None = None, accelerate_version: str | None = None) -> None:
    """Raise ``RuntimeError`` with one sentence when transformers or accelerate is outside the range
    the integration runs on (the installed versions unless given)."""
    if transformers_version is None:
        transformers_version = installed("transformers")
    if accelerate_version is None:
        accelerate_version = installed("accelerate")
    problems = []
    if all(_outside(transformers_version, bounds) for bounds in TRANSFORMERS):
        # The nearest accepted range: 4.x stays on 4.x.
        low, high = TRANSFORMERS[0] if legacy_loop(transformers_version) else TRANSFORMERS[-1]
        problems.append(
            f"transformers {transformers_version} is installed and AdaptiveBatchSizeTrainer runs on "
            f"transformers {_accepted()} (the Trainer loops it plugs into, and DeepSpeed configs that "
            f'deepspeed 0.19.8 accepts): pip install "transformers>={low},<{high}"'
        )
    if _outside(accelerate_version, ACCELERATE):
        problems.append(
            f"accelerate {accelerate_version} is installed and AdaptiveBatchSizeTrainer is tested with "
            f'accelerate >= {ACCELERATE[0]}, < {ACCELERATE[1]}: pip install "accelerate>={ACCELERATE[0]},'
            f'<{ACCELERATE[1]}"'
        )
    if problems:
        raise RuntimeError("; ".join(problems))
