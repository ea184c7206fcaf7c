"""Each rank's peak memory per pass as a function of its micro-batch, learned from the allocator.

A grow-back probe of the learned micro-batch limit (:mod:`ds_adabatch.runtime.memory.limit`) costs a
recovered out-of-memory error whenever the size it tries does not fit. The predictor avoids those: it
reads the allocator's own counters on the host around every forward/backward pass (DeepSpeed's
accelerator API, 0.19.8: ``memory_allocated``, ``max_memory_allocated``, ``reset_peak_memory_stats``;
on CUDA these read the caching allocator's statistics, the first two in one read, and never synchronise
the device) and models

    peak(x) = resident + c + b * x

where ``resident`` is what the allocator holds when a pass starts (parameters, gradients, optimizer
state: read at every pass, so it follows the optimizer's first allocation or a freed cache), ``x`` the
pass's size in the limit's unit (samples per pass, or tokens per pass, padding included, with
``micro_batch_tokens``), and ``c + b * x`` the activations. One observed size gives the line through
the origin (``c = 0``, ``b`` its bytes per unit: never below the true line at larger sizes when
``c >= 0``); two or more give the least-squares line over each size's largest observation, raised until
no observation lies above it. A model is kept per memory key (``engine.set_memory_key``). Peaks of
passes that ran out of memory (here or on another rank) are dropped: they stopped early.

The verdict is the largest size whose predicted peak stays within ``(1 - peak_margin) x`` the device's
memory (``memory.device_memory_bytes``, else the accelerator's ``total_memory``). It is a bound on
growth, agreed as the minimum over ranks inside the out-of-memory agreement (no collective of its own)
and applied to the next step's plan: a probe above it is never tried.

A pass's size is read from the wrapped model's input (a forward pre-hook, no device access): the leading
dimension of its first tensor (samples), or that tensor's number of elements (tokens).

The allocator has one peak counter per device, and reading a pass's own peak means resetting it before
the pass (``reset_peak_memory_stats``): while the predictor measures, ``torch.cuda.max_memory_allocated()``
reads the peak since the current pass began, not since the process started. Every peak is folded into
the predictor's own counters before each reset, so nothing is lost: ``engine.max_memory_allocated()`` is
the process's peak (what ``torch.cuda.max_memory_allocated()`` would have read), and each step's JSONL
record has ``peak_memory_bytes``, the largest peak of that step's passes and optimizer step on the rank
(rank 0's in the file). A script that resets the counter itself (per-step monitoring) reads these
instead; ``memory.predict_peak: false`` leaves the counter alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any

import torch

from .stand_ins import first_batched, memory_stand_in

__all__ = ["PeakMemoryModel", "PeakPredictor"]


class PeakMemoryModel:
    """Pure bookkeeping: observations ``(size, resident bytes, peak bytes)`` per key, and the verdict."""

    def __init__(self) -> None:
        self._activations: dict[Hashable, dict[int, int]] = {}  # key -> size -> largest peak - resident
        self._resident: dict[Hashable, int] = {}

    def observe(self, key: Hashable, size: int, resident: int, peak: int) -> None:
        if size < 1:
            return
        sizes = self._activations.setdefault(key, {})
        sizes[size] = max(sizes.get(size, 0), max(peak - resident, 0))
        self._resident[key] = resident

    def line(self, key: Hashable) -> tuple[float, float] | None:
        """``(c, b)`` of the activations ``c + b * size`` for ``key``; None before any observation."""
        sizes = self._activations.get(key)
        if not sizes:
            return None
        if len(sizes) == 1:
            ((size, act),) = sizes.items()
            return 0.0, act / size
        xs, ys = list(sizes), list(sizes.values())
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mean_x) ** 2 for x in xs)
        slope = max(sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var, 0.0)
        # Raised through the highest observation above it: never below what was seen.
        intercept = max(y - slope * x for x, y in zip(xs, ys))
        return intercept, slope

    def predict(self, key: Hashable, size: int) -> float | None:
        """Predicted peak bytes of a pass of ``size`` under ``key`` (None: nothing observed yet)."""
        fit = self.line(key)
        return None if fit is None else self._resident[key] + fit[0] + fit[1] * size

    def largest_fitting(self, key: Hashable, budget: float) -> int | None:
        """The largest size whose predicted peak is at most ``budget`` bytes (at least 1); None when
        nothing is known or every size fits (activations do not grow with the size)."""
        fit = self.line(key)
        if fit is None or fit[1] <= 0:
            return None
        room = budget - self._resident[key] - fit[0]
        return max(1, math.floor(room / fit[1] + 1e-9))


class PeakPredictor:
    """Reads the allocator around the passes of one engine and keeps a :class:`PeakMemoryModel`.

    ``begin_pass()`` before each pass (it closes the one before: that pass's peak includes everything
    up to now, so the optimizer step belongs to its step's last pass); ``discard_pass()`` when the open
    pass ran out of memory; ``verdict()`` is this rank's bound for the agreement.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        device: torch.device | str,
        unit: str,
        margin: float,
        device_memory_bytes: int | None,
        key: Callable[[], Hashable],
        measure: bool = True,
    ) -> None:
        self.model = PeakMemoryModel()
        self.measure = measure  # False: only the size of each pass is kept (for out-of-memory records)
        self.unit = unit  # "samples" or "tokens"
        self.margin = margin
        self.device_memory_bytes = device_memory_bytes
        self._on_accelerator = torch.device(device).type != "cpu"
        self._key = key  # a callable returning the current memory key
        self._open: tuple[Hashable, int] | None = None  # (key, resident bytes) of the running pass
        self._size: int | None = None
        self.reads = 0  # allocator reads so far (benchmarks report them)
        self._process_peak = 0  # the largest peak read before any reset (bytes)
        self._step_peak = 0  # the largest peak since take_step_peak()
        self._counted = False  # the open pass's peak went into the last take_step_peak()
        self._accelerator: Any = None  # the accelerator's counters, once looked up
        # with_kwargs: model(**batch) passes its tensors as keyword arguments.
        self._hook = module.register_forward_pre_hook(self._record_size, with_kwargs=True)

    def _record_size(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._size is None:
            first = first_batched(list(args) + list(kwargs.values()))
            if first is not None:
                self._size = int(first.shape[0]) if self.unit == "samples" else int(first.numel())

    def _counters(self) -> Any:
        """A memory stand-in when one is installed here (stand_ins.py), else the accelerator's (None on the CPU)."""
        if not self.measure:
            return None
        simulated = memory_stand_in()
        if simulated is not None:
            return simulated
        if not self._on_accelerator:
            return None
        if self._accelerator is None:  # looked up once: this runs before every pass
            self._accelerator = _allocator_counters()
        return self._accelerator

    def begin_pass(self) -> None:
        counters = self._counters()
        if counters is None:
            self._open, self._size = None, None
            return
        peak, resident = _peak_and_resident(counters)
        self._process_peak = max(self._process_peak, peak)
        if not self._counted:
            self._step_peak = max(self._step_peak, peak)
        self._counted = False
        self._close(peak)
        self.reads += 3
        counters.reset_peak_memory_stats()
        self._open, self._size = (self._key(), resident), None

    def max_memory_allocated(self) -> int | None:
        """The peak allocated since the process started (bytes; every reset folded in), None where
        nothing is measured."""
        counters = self._counters()
        if counters is None:
            return None
        return max(self._process_peak, int(counters.max_memory_allocated()))

    def take_step_peak(self) -> int | None:
        """The largest peak since the last call (bytes), the running pass included; None where nothing
        is measured or no pass ran."""
        counters = self._counters()
        if counters is None or (self._open is None and not self._step_peak):
            return None
        peak = max(self._step_peak, int(counters.max_memory_allocated()))
        self._step_peak, self._counted = 0, True
        return peak

    @property
    def pass_size(self) -> int | None:
        """The size of the pass that ran (or is running) last, in the limit's unit."""
        return self._size

    def discard_pass(self) -> None:
        """The open pass ran out of memory (on this rank or another): its peak stopped early."""
        self._open = None

    def _close(self, peak: int) -> None:
        if self._open is None or not self._size:
            return
        key, resident = self._open
        self.model.observe(key, self._size, resident, peak)
        self._open = None

    def capacity(self) -> int | None:
        if self.device_memory_bytes is not None:
            return self.device_memory_bytes
        counters = self._counters()
        if counters is None:
            return None
        total = counters.total_memory()
        return None if total is None else int(total)

    def verdict(self) -> int | None:
        """The largest pass size (the limit's unit) predicted to fit on this rank; None: no bound known."""
        capacity = self.capacity()
        if capacity is None:
            return None
        return self.model.largest_fitting(self._key(), capacity * (1.0 - self.margin))

    def close(self) -> None:
        self._hook.remove()


class _CudaCounters:
    """The CUDA caching allocator's counters, the peak and the resident bytes read in one call.

    DeepSpeed's CUDA accelerator (0.19.8) reads each through ``torch.cuda.max_memory_allocated()`` /
    ``memory_allocated()``, each of which flattens and sorts the allocator's whole statistics
    (``torch.cuda.memory_stats``, a few hundred entries) to return one number. Before every pass that
    cost twice a large share of a small step's host time. ``torch.cuda.memory_stats_as_nested_dict``
    is the dictionary those are flattened from: the same two numbers, for the current device, from one
    read.
    """

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def peak_and_resident(self) -> tuple[int, int]:
        allocated = torch.cuda.memory_stats_as_nested_dict().get("allocated_bytes", {}).get("all", {})
        return int(allocated.get("peak", 0)), int(allocated.get("current", 0))

    def max_memory_allocated(self) -> int:
        return self.peak_and_resident()[0]

    def memory_allocated(self) -> int:
        return self.peak_and_resident()[1]

    def reset_peak_memory_stats(self) -> None:
        self.accelerator.reset_peak_memory_stats()

    def total_memory(self) -> int | None:
        return self.accelerator.total_memory()


def _allocator_counters() -> Any:
    """The accelerator's allocator counters (on CUDA, read in one call: :class:`_CudaCounters`)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cuda" and torch.cuda.is_available():
        return _CudaCounters(accelerator)
    return accelerator


def _peak_and_resident(counters: Any) -> tuple[int, int]:
    """The allocator's peak since its last reset and the bytes it holds now."""
    read_both = getattr(counters, "peak_and_resident", None)
    if read_both is not None:
        return read_both()
    return int(counters.max_memory_allocated()), int(counters.memory_allocated())
