"""Token-budget steps for ``ds-adabatch simulate``: the runtime's sampler and packer over given lengths.

With ``micro_batch_tokens`` no planner splits a step: its samples are packed into passes by their
lengths (:mod:`ds_adabatch.data.packing`). :class:`PackedSteps` forms every simulated step as a run
over a dataset of those lengths would: the same global order (the ``data`` section's ``seed``,
``shuffle`` and ``drop_last``), bucket window, padding, truncation and packer, dealt to the simulated
world size; so the simulation's passes, tokens and epoch tails are the ones the run would take.
:func:`read_lengths` reads the lengths from a file: ``.npy`` (a 1-d integer array), ``.json`` (a
list of integers), or text (integers separated by white space or commas, e.g. one per line).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ..schedules.simulate import SimulatedStep
from .lengths import SampleLengths
from .token_config import sampler_for_config

__all__ = ["PackedSteps", "read_lengths"]


def read_lengths(path: str | os.PathLike[str]) -> np.ndarray:
    """Every sample's length in tokens from ``path``, in dataset order (module docstring).

    Raises:
        ValueError: the file is empty or holds anything but integer lengths (named with the file).
    """
    name = os.fspath(path)
    try:
        if name.endswith(".npy"):
            values = np.load(name, allow_pickle=False)
        elif name.endswith(".json"):
            with open(name, encoding="utf-8") as handle:
                values = np.asarray(json.load(handle))
        else:
            with open(name, encoding="utf-8") as handle:
                text = handle.read().replace(",", " ").split()
            values = np.asarray([int(word) for word in text], dtype=np.int64)
    except (ValueError, json.JSONDecodeError) as err:
        raise ValueError(f"{name}: not a list of sample lengths in tokens ({err})") from None
    if values.ndim != 1 or values.size == 0 or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(
            f"{name}: expected one integer length (tokens) per sample, got an array of shape "
            f"{values.shape} and type {values.dtype}"
        )
    return values


class PackedSteps:
    """The simulated steps of a token-budget config over a dataset of ``lengths`` (module docstring); a
    :class:`~ds_adabatch.schedules.simulate.StepSource` for
    :func:`~ds_adabatch.schedules.simulate.simulate`.

    Args:
        loaded_config: A ``LoadedConfig`` whose ``adabatch`` section sets ``micro_batch_tokens``.
        lengths: One length in tokens per sample, in dataset order (or a :class:`SampleLengths`).

    Raises:
        ValueError: the config has no token budget, a length is below 1, or a sample is longer than
            the budget without ``truncate_long_samples`` (named with its index and length).
    """

    def __init__(self, loaded_config: Any, lengths: Any) -> None:
        cfg = loaded_config.adabatch
        if not cfg.token_budget:
            raise ValueError(
                "sample lengths only apply with adabatch.micro_batch_tokens (token-budget steps): set "
                "micro_batch_tokens in the config, or drop the lengths"
            )
        if not isinstance(lengths, SampleLengths):
            array = np.asarray(lengths)
            lengths = SampleLengths(int(array.shape[0]) if array.ndim == 1 else 0, lengths=array)
        data = cfg.data
        self.sampler = sampler_for_config(
            cfg, lengths, shuffle=data.shuffle, seed=data.seed, drop_last=data.drop_last
        )
        self.max_micro = cfg.max_micro_batch_per_gpu if isinstance(cfg.max_micro_batch_per_gpu, int) else None

    @property
    def bucket_window(self) -> int:
        """The config's ``bucket_window`` (the goodput model packs recent lengths after a whole one)."""
        return self.sampler.bucket_window

    @property
    def pass_budget(self) -> int:
        """The token budget the steps are cut with (``micro_batch_tokens``: a simulation has no
        out-of-memory error to lower it)."""
        return self.sampler.pass_budget

    @property
    def tokens_consumed(self) -> int:
        return self.sampler.tokens_consumed

    @property
    def fractional_epoch(self) -> float:
        return self.sampler.fractional_epoch

    def take(self, global_batch: int, world_size: int) -> SimulatedStep:
        """The next step of ``global_batch`` (samples, or tokens for a schedule in tokens), packed."""
        step = self.sampler.next_step(global_batch, world_size)
        plan = step.plan(self.max_micro)
        return SimulatedStep(
            samples=step.size,
            micro_batch_per_gpu=plan.micro_batch_per_gpu,
            gradient_accumulation_steps=step.passes,
            even=plan.is_even,
            budget=step.budget,
            lengths=step.lengths,
        )

    def passes_of(self, lengths: Any, world_size: int, budget: int) -> int:
        """Passes per rank samples of ``lengths`` pack into, as the runtime's sampler packs them."""
        return self.sampler.passes_of(lengths, world_size, budget)
