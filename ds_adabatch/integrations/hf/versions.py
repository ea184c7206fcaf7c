"""The transformers and accelerate releases ``AdaptiveBatchSizeTrainer`` runs on, checked at construction.

Accepted: transformers 4.57.6 (the last 4.x) up to the newest 5.x, with accelerate 1.15+. CI runs every
Trainer test on the newest release and a focused suite on 4.57.6, 5.0.0, 5.2.0, 5.3.0 and 5.17.0
(``scripts/test_hf_floor.sh``: the first and last release of each kind below). What differs between
them, and where ``hf.compat`` makes up for it (inspected in every 5.x release's ``trainer.py`` and
``integrations/deepspeed.py``; the lines below are where each changed):

* 4.57.6 and 5.0-5.2 (:func:`legacy_loop`) run the Trainer's loop in one function,
  ``_inner_training_loop``; ``hf.compat.OneFunctionLoop`` reaches each step there. 5.1 moved the
  scheduler's creation after ``accelerator.prepare`` (``create_optimizer`` then ``create_scheduler``,
  no more ``create_optimizer_and_scheduler``). 5.3 split the loop into the methods below, whose
  signatures and call sites are the same from 5.3.0 to 5.24.0.
* Before 5.18 (:func:`plain_trainer_faults`) the plain ``Trainer`` fills a DeepSpeed scheduler's
  ``"auto"`` ``warmup_num_steps`` with 0 when ``TrainingArguments`` has no warmup, which deepspeed
  0.19.8 refuses (5.18 fills ``max(1, steps)``), and resumes a multi-process CPU run's optimizer with
  ``map_location=args.device``, which torch cannot restore under accelerate 1.15 (``cpu:0``; 5.18 loads
  on ``"cpu"``). Measured on 4.57.6 and 5.3.0: each stops its run. ``hf.compat.PlainTrainerFixes`` does
  what 5.18 does, on those releases.
* 4.x (:func:`transformers_4`) takes DeepSpeed's input dtype as fp16 unless the config says otherwise
  (``hf.compat.adapt_arguments``).

Refused: 4.x before 4.57.6 (not tested; the field's 4.x stacks pin 4.57.x and 4.57.6 is its last patch
release) and 6.x (not released). Anything outside :data:`TRANSFORMERS` / :data:`ACCELERATE` is refused
when the trainer is built, with one sentence, before any process group starts; ``setup.py`` states the
same (:data:`REQUIREMENT`).

The transformers methods the integration overrides that are not public API, each with the same
signature and call site in every release from 5.3.0 to 5.24.0; 4.57.6 and 5.0-5.2 reach the same steps
through other methods (``hf.compat``):

=================================  ======================================================================
``set_initial_training_values``    ``(args, dataloader)``: steps per epoch and of the run, from the schedule
                                   (4.57.6-5.2: ``(args, dataloader, total_train_batch_size)``)
``_init_training_state``           the resumed epoch/step counters (the sample cursor is ours)
``_prepare_for_training``          ``(max_steps, train_dataloader, resume_from_checkpoint)``; the banner's GAS
``get_batch_samples``              ``(epoch_iterator, num_batches, device)``: one item = one optimizer step
``training_step``                  ``(model, inputs, num_items_in_batch)``: the step's weighted passes
``_save_checkpoint``               ``(model, trial)``: ``adabatch_state.json`` beside ``trainer_state.json``
``_maybe_log_save_evaluate``       resolves pending step records before logging
``_track_num_input_tokens``        the tokens of the step's passes
``_load_callback_state``           ``()``, 4.57.6-5.2: the resumed batch state (``hf.compat``)
``_load_optimizer_and_scheduler``  ``(checkpoint)``, before 5.18: the CPU resume (``hf.compat``)
=================================  ======================================================================

``TrainingArguments.dataloader_multiprocessing_context`` is read where it exists.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ACCELERATE",
    "POSITIVE_WARMUP_AND_CPU_RESUME",
    "REQUIREMENT",
    "SPLIT_LOOP",
    "TRANSFORMERS",
    "check_versions",
    "installed",
    "legacy_loop",
    "plain_trainer_faults",
    "transformers_4",
]

TRANSFORMERS: tuple[tuple[str, str], ...] = (("4.57.6", "6"),)
"""``[low, high)`` ranges: the transformers releases the integration runs on (4.57.6, the last 4.x, up
to the newest 5.x; CI runs the Trainer tests on 4.57.6, 5.0.0, 5.2.0, 5.3.0, 5.17.0 and the newest)."""
REQUIREMENT = "transformers>=4.57.6,<6"
"""The same ranges as a pip requirement (``setup.py``'s ``hf`` and ``dev`` extras)."""
ACCELERATE = ("1.15.0", "2")
"""``[low, high)``: the accelerate releases it runs on (1.15, tested with every transformers above)."""
SPLIT_LOOP = "5.3.0"
"""The first release whose ``Trainer._inner_training_loop`` calls ``_init_training_state``,
``_prepare_for_training`` and ``_run_epoch``; before it, ``hf.compat`` reaches the one-function loop."""
POSITIVE_WARMUP_AND_CPU_RESUME = "5.18.0"
"""The first release that fills an ``"auto"`` ``warmup_num_steps`` with ``max(1, steps)`` and resumes a
multi-process CPU run's optimizer on ``"cpu"``; before it, ``hf.compat`` does both."""


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


def _before(release: str, transformers_version: str | None) -> bool:
    found = installed("transformers") if transformers_version is None else transformers_version
    return _version(found) < _version(release)


def legacy_loop(transformers_version: str | None = None) -> bool:
    """Whether transformers (the installed release unless given) has the one-function training loop of
    4.57 (4.57.6 and 5.0-5.2; 5.3 split it into the methods ``hf.trainer`` overrides)."""
    return _before(SPLIT_LOOP, transformers_version)


def transformers_4(transformers_version: str | None = None) -> bool:
    """Whether transformers (the installed release unless given) is a 4.x release (its DeepSpeed input
    dtype, its models' ``forward`` signatures, its loss rounding in the logs)."""
    return _before("5", transformers_version)


def plain_trainer_faults(transformers_version: str | None = None) -> bool:
    """Whether transformers (the installed release unless given) fills an ``"auto"`` ``warmup_num_steps``
    with 0 and resumes a multi-process CPU optimizer on ``args.device`` (releases before 5.18)."""
    return _before(POSITIVE_WARMUP_AND_CPU_RESUME, transformers_version)


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
        low, high = TRANSFORMERS[0] if transformers_4(transformers_version) else TRANSFORMERS[-1]
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
