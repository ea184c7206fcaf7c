"""Every training sample's length in tokens, for an ``AdaptiveBatchSizeTrainer`` with ``micro_batch_tokens``.

The first source that applies is used:

1. ``lengths=`` (one integer per sample) or ``length_fn=`` (``fn(sample) -> int``) given to the trainer;
2. the dataset's ``TrainingArguments.length_column_name`` column (default ``"length"``), the column the
   Hugging Face ``group_by_length`` sampler reads: a dataset with ``column_names`` (a
   ``datasets.Dataset``) has it read once, as one Arrow column, before any step;
3. per sample, when a step first reaches it (then cached): the value of that column's key when the
   sample is a mapping holding it, else ``len(sample[input_name])`` with ``input_name`` the model's main
   input (``processing_class.model_input_names[0]``, else ``"input_ids"``), as ``group_by_length``
   measures a sample.

Lengths count what ``micro_batch_tokens`` counts: tokens of the model's main input before padding.
This module does not import transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ds_adabatch.data.lengths import SampleLengths

__all__ = ["check_length_arguments", "sample_lengths"]


def check_length_arguments(lengths: Any, length_fn: Any) -> None:
    """Refuse ``lengths=`` and ``length_fn=`` together, or a ``length_fn`` that is not callable.

    Raises:
        ValueError: both are given, or ``length_fn`` is not callable.
    """
    if lengths is not None and length_fn is not None:
        raise ValueError("give either lengths= or length_fn= to AdaptiveBatchSizeTrainer, not both")
    if length_fn is not None and not callable(length_fn):
        raise ValueError(f"length_fn must be callable as length_fn(sample) -> int, got {length_fn!r}")


def sample_lengths(
    dataset: Any,
    *,
    lengths: Any = None,
    length_fn: Callable[[Any], int] | None = None,
    column: str = "length",
    input_name: str = "input_ids",
) -> SampleLengths:
    """The :class:`~ds_adabatch.data.lengths.SampleLengths` of ``dataset`` (see the module docstring).

    Args:
        dataset: The training dataset as the user gave it (before the Trainer removes the columns the
            model does not take: the length column is one of them).
        lengths: One length (tokens, >= 1) per sample, or None.
        length_fn: ``length_fn(dataset[i]) -> int``, or None.
        column: ``TrainingArguments.length_column_name``.
        input_name: The sample key whose length is measured when nothing else gives it.

    Raises:
        ValueError: both arguments given, lengths of the wrong size or not positive integers, or (when
            nothing gives the lengths) a first sample that has neither ``column`` nor ``input_name``.
    """
    check_length_arguments(lengths, length_fn)
    n = len(dataset)
    if lengths is not None:
        return SampleLengths(n, lengths=_as_array(lengths, "lengths="))
    if length_fn is not None:
        return SampleLengths(n, length_fn=length_fn, dataset=dataset)
    values = _column(dataset, column)
    if values is not None:
        return SampleLengths(n, lengths=_as_array(values, f"the {column!r} column"))
    if n:
        _check_measurable(dataset[0], column, input_name, "sample 0")
    return SampleLengths(n, length_fn=_SampleLength(column, input_name), dataset=dataset)


def _as_array(values: Any, source: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim == 1 and array.size and array.dtype.kind == "f":
        # A float column of whole numbers (pandas or Arrow after a null) is accepted as integers.
        if not np.all(np.isfinite(array)) or not np.all(array == np.round(array)):
            raise ValueError(f"{source} must hold whole numbers of tokens, got dtype {array.dtype}")
        array = array.astype(np.int64)
    return array


def _column(dataset: Any, column: str) -> Any:
    """The whole length column of a dataset that has one (one read), else None."""
    names = getattr(dataset, "column_names", None)
    if not isinstance(names, (list, tuple)) or column not in names:
        return None
    with_format = getattr(dataset, "with_format", None)
    # datasets.Dataset: in Arrow format the column comes back as one Arrow array with the dataset's
    # indices mapping (select, shuffle) applied, with no Python call per row (datasets 4.0: a plain
    # dataset[column] is a lazy Column converted row by row).
    values = with_format("arrow")[column] if callable(with_format) else dataset[column]
    to_numpy = getattr(values, "to_numpy", None)
    return to_numpy() if callable(to_numpy) else values


def _check_measurable(sample: Any, column: str, input_name: str, where: str) -> None:
    if isinstance(sample, Mapping) and (column in sample or input_name in sample):
        return
    keys = sorted(map(str, sample)) if isinstance(sample, Mapping) else type(sample).__name__
    raise ValueError(
        "adabatch.micro_batch_tokens needs every sample's length in tokens, but the samples have no "
        f"{column!r} or {input_name!r} to read it from ({where}: {keys}); pass lengths=[...] or "
        "length_fn=lambda sample: ... to AdaptiveBatchSizeTrainer, or set "
        "TrainingArguments(length_column_name=...)"
    )


class _SampleLength:
    """``length_fn`` of the default: the sample's length key, else the length of its main input."""

    def __init__(self, column: str, input_name: str) -> None:
        self.column, self.input_name = column, input_name

    def __call__(self, sample: Any) -> int:
        _check_measurable(sample, self.column, self.input_name, "a sample")
        if self.column in sample:
            return _whole(sample[self.column])
        return len(sample[self.input_name])

    def __repr__(self) -> str:
        return f"sample[{self.column!r}] if present, else len(sample[{self.input_name!r}])"


def _whole(value: Any) -> Any:
    # A 0-d tensor or array (a formatted dataset) reads as its Python number; SampleLengths checks it.
    item = getattr(value, "item", None)
    return item() if callable(item) and getattr(value, "ndim", 1) == 0 else value
