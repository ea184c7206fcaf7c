"""Test helpers for users of ds_adabatch: simulate running out of GPU memory on a CPU.

``simulated_memory_limit`` makes every forward pass (or its backward) that holds more samples (or more
tokens) than a budget raise ``torch.OutOfMemoryError``, on the ranks you choose, so the out-of-memory
recovery of ``"adabatch".memory`` can be exercised on any machine::

    from ds_adabatch.testing import simulated_memory_limit

    with simulated_memory_limit(6, ranks=[1]) as budget:   # rank 1 fits 6 samples per forward
        engine.train_batch()                               # micro 8 -> OOM on rank 1 -> micro 4
        budget.max_samples_per_forward = 12                # the budget rises mid-run

    # token-budget steps: a forward over more than 1024 tokens (padding included) fails
    with simulated_memory_limit(max_tokens_per_forward=1024):
        engine.train_batch()

    # a simulated *memory*: a pass needs 1 kB plus 100 B per sample of a 1650 B device (6 samples fit);
    # it also feeds the runtime's peak-memory predictor, as an accelerator's allocator counters would
    with simulated_memory_limit(device_memory_bytes=1650, fixed_bytes=1000, bytes_per_sample=100):
        engine.train_batch()
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch

from .runtime.memory import stand_ins

__all__ = ["SimulatedMemoryLimit", "simulated_limit_installed", "simulated_memory", "simulated_memory_limit"]


def simulated_limit_installed() -> bool:
    """Whether a :func:`simulated_memory_limit` is installed in this process (it arms the
    out-of-memory agreement on the CPU, where no real out-of-memory error can be recovered)."""
    return any(isinstance(s, SimulatedMemoryLimit) for s in stand_ins._oom_stand_ins)


def simulated_memory() -> SimulatedMemoryLimit | None:
    """The newest installed :func:`simulated_memory_limit` with a simulated memory
    (``device_memory_bytes``) that applies to this rank, else None. The runtime reads its counters in
    place of the accelerator's (:mod:`ds_adabatch.runtime.memory.predictor`, through
    :mod:`ds_adabatch.runtime.memory.stand_ins`)."""
    found = stand_ins.memory_stand_in()
    return found if isinstance(found, SimulatedMemoryLimit) else None


def _first_grad_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor that requires grad in a model output (a tensor, a mapping such as Hugging
    Face's ``ModelOutput`` with ``loss`` first, or a sequence)."""
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    items = (
        value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    )
    for item in items:
        found = _first_grad_tensor(item)
        if found is not None:
            return found
    return None


class SimulatedMemoryLimit:
    """An installed budget (see :func:`simulated_memory_limit`); a context manager.

    Attributes:
        max_samples_per_forward: the budget, in samples per forward pass (None: no bound); change it
            at any time.
        max_tokens_per_forward: the budget in tokens per forward pass: the number of elements of the
            forward's first tensor (samples x padded length for token ids; None: no bound).
        device_memory_bytes, fixed_bytes, bytes_per_sample, bytes_per_token: the simulated memory (None:
            none): a pass needs ``fixed + per sample x samples + per token x tokens`` bytes and fails
            when that exceeds ``device_memory_bytes``; change them at any time.
        raised: how many simulated out-of-memory errors this process raised so far.
        calls: outermost forward calls seen on this rank since install (failed ones included).
    """

    def __init__(
        self,
        max_samples_per_forward: int | None,
        ranks: Iterable[int] | None,
        phase: Literal["forward", "mid_forward", "backward"],
        fail_calls: Iterable[int] = (),
        max_tokens_per_forward: int | None = None,
        memory: tuple[int | None, int, int, int] = (None, 0, 0, 0),
    ) -> None:
        if phase not in ("forward", "mid_forward", "backward"):
            raise ValueError(f"phase must be 'forward', 'mid_forward' or 'backward', got {phase!r}")
        if max_samples_per_forward is None and max_tokens_per_forward is None and memory[0] is None:
            raise ValueError(
                "give max_samples_per_forward, max_tokens_per_forward, device_memory_bytes or more"
            )
        if any(v < 0 for v in memory[1:]) or (memory[0] is not None and memory[0] < 1):
            raise ValueError(f"simulated memory sizes must be >= 0 bytes (device >= 1), got {memory}")
        self.max_samples_per_forward = (
            None if max_samples_per_forward is None else int(max_samples_per_forward)
        )
        self.max_tokens_per_forward = None if max_tokens_per_forward is None else int(max_tokens_per_forward)
        self.ranks = None if ranks is None else {int(r) for r in ranks}
        self.phase = phase
        self.fail_calls = {int(c) for c in fail_calls}
        self.device_memory_bytes, self.fixed_bytes, self.bytes_per_sample, self.bytes_per_token = memory
        self.raised = 0
        self.calls = 0
        self._peak = 0  # the simulated allocator's peak since its last reset (bytes)
        self._leaves = 0  # leaf modules this forward reached
        self._depth = 0
        self._samples: int | None = None
        self._tokens: int | None = None
        self._checked = False  # this forward's budget was checked (at its first leaf module)
        self._handles: list[Any] = []

    def applies_here(self) -> bool:
        """Whether this rank is one of ``ranks`` (the runtime reads a simulated memory only there)."""
        return self._active_here()

    def _active_here(self) -> bool:
        if self.ranks is None:
            return True
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return rank in self.ranks

    def _oom(self, samples: int, tokens: int | None, where: str) -> torch.OutOfMemoryError:
        self.raised += 1
        need = self.pass_bytes(samples, tokens or 0)
        return torch.OutOfMemoryError(
            f"simulated out of memory in {where}: {samples} samples ({tokens} tokens) per forward "
            f"exceed the budget of {self.max_samples_per_forward} samples / "
            f"{self.max_tokens_per_forward} tokens / {self.device_memory_bytes} bytes ({need} needed)"
        )

    def pass_bytes(self, samples: int, tokens: int) -> int:
        """The simulated peak of a pass over ``samples`` samples of ``tokens`` tokens (bytes)."""
        return self.fixed_bytes + self.bytes_per_sample * samples + self.bytes_per_token * tokens

    def _over(self, samples: int | None, tokens: int | None) -> bool:
        if samples is None:
            return False
        if self.calls in self.fail_calls:
            return True
        limit, token_limit = self.max_samples_per_forward, self.max_tokens_per_forward
        need = self.pass_bytes(samples, tokens or 0)
        if (
            (limit is not None and samples > limit)
            or (token_limit is not None and tokens is not None and tokens > token_limit)
            or (self.device_memory_bytes is not None and need > self.device_memory_bytes)
        ):
            return True
        self._peak = max(self._peak, need)  # the pass fits: the allocator reaches its peak
        return False

    # -- the simulated allocator's counters (what the runtime reads on an accelerator) -------------
    def memory_allocated(self) -> int:
        """Bytes held between passes: the fixed part."""
        return self.fixed_bytes

    def max_memory_allocated(self) -> int:
        """The largest pass peak since :meth:`reset_peak_memory_stats` (at least the fixed part)."""
        return max(self._peak, self.fixed_bytes)

    def reset_peak_memory_stats(self) -> None:
        self._peak = 0

    def total_memory(self) -> int | None:
        return self.device_memory_bytes

    def _pre(self, module: torch.nn.Module, args: tuple) -> None:
        self._depth += 1
        if not self._active_here():
            return
        if self._depth == 1:
            self.calls += 1
            self._samples = self._tokens = None
            self._checked = False
            self._leaves = 0
        if self._samples is None:
            # The batch size is the first positional tensor of the outermost call, or (when that call
            # takes keyword arguments only, like model(**batch)) of the first module call below it.
            first = stand_ins.first_batched(args)
            if first is not None:
                self._samples, self._tokens = int(first.shape[0]), int(first.numel())
        if next(module.children(), None) is not None:
            return
        self._leaves += 1
        # A forward-phase error is raised where the model starts computing, as a real one would be:
        # at its first leaf module (e.g. the embedding), after the hooks of the modules around it
        # (ZeRO-3's start-of-forward hook communicates in the first steps), before that leaf runs.
        # "mid_forward" raises at the second leaf, after the first one ran (and, under ZeRO-3 with
        # partitioned parameters, after its parameters were gathered).
        at = {"forward": 1, "mid_forward": 2}.get(self.phase)
        if self._leaves == at and not self._checked:
            self._check("forward" if at == 1 else "the middle of the forward")

    def _check(self, where: str) -> None:
        self._checked = True
        if self._over(self._samples, self._tokens):
            raise self._oom(self._samples or 0, self._tokens, where)

    def _post(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self._depth -= 1
        if self._depth != 0 or not self._active_here():
            return
        if self.phase == "mid_forward" and not self._checked:
            self._check("the end of the forward")  # a model with a single leaf module
        if self.phase != "backward":
            return
        samples, tokens = self._samples, self._tokens
        out = _first_grad_tensor(output)
        if out is None or not self._over(samples, tokens):
            return

        def fail(grad: torch.Tensor) -> None:
            raise self._oom(samples or 0, tokens, "backward")

        out.register_hook(fail)

    def install(self) -> SimulatedMemoryLimit:
        """Start raising (the context manager calls it)."""
        hooks = torch.nn.modules.module
        if not self._handles:
            stand_ins.install_oom_stand_in(self, simulates_memory=self.device_memory_bytes is not None)
        self._handles = [
            hooks.register_module_forward_pre_hook(self._pre),
            # always_call: the depth count stays right when a forward (or this pre-hook) raises.
            hooks.register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def remove(self) -> None:
        """Stop raising."""
        if self._handles:
            stand_ins.remove_oom_stand_in(self)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._depth = 0

    def __enter__(self) -> SimulatedMemoryLimit:
        return self.install()

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


def simulated_memory_limit(
    max_samples_per_forward: int | None = None,
    ranks: Iterable[int] | None = None,
    *,
    phase: Literal["forward", "mid_forward", "backward"] = "forward",
    fail_calls: Iterable[int] = (),
    max_tokens_per_forward: int | None = None,
    device_memory_bytes: int | None = None,
    fixed_bytes: int = 0,
    bytes_per_sample: int = 0,
    bytes_per_token: int = 0,
) -> SimulatedMemoryLimit:
    """Make forward passes over more than ``max_samples_per_forward`` samples (or more than
    ``max_tokens_per_forward`` tokens, or needing more simulated memory than ``device_memory_bytes``)
    run out of memory.

    The check applies to the outermost module call (your model, or the DeepSpeed engine wrapping it):
    the leading dimension of its first positional tensor (or, for ``model(**batch)``, of the first
    module call below it that takes one, such as the embedding) is the number of samples, and that
    tensor's number of elements the number of tokens (samples x padded length for ``input_ids``; a
    model fed packed rows counts the row). ``phase="forward"`` raises
    ``torch.OutOfMemoryError`` when the forward reaches its first leaf module (one without submodules,
    e.g. the embedding), before that module runs; ``phase="mid_forward"`` when it reaches its second
    leaf module, after the first one ran (under ZeRO-3 with partitioned parameters that is after a
    parameter gather: not recoverable inside the step); ``phase="backward"`` lets the forward run and
    raises when backward reaches the model's output (its first tensor that requires grad, e.g. a
    Hugging Face output's ``loss``): the start of backward, before any gradient is reduced. Only the ranks in ``ranks`` (``torch.distributed`` ranks; None: every rank) raise.
    ``fail_calls`` also fails the n-th outermost forward on such a rank (1-based, counted from install),
    whatever its size: an OOM in the middle of an accumulation, after other micro-batches were summed.

    A simulated *memory* (``device_memory_bytes``): a pass over ``s`` samples of ``t`` tokens needs
    ``fixed_bytes + bytes_per_sample * s + bytes_per_token * t`` bytes and fails when that exceeds
    ``device_memory_bytes``. On those ranks the runtime's peak-memory predictor (``"adabatch".memory.
    predict_peak``) reads the simulated allocator (``memory_allocated``: the fixed part;
    ``max_memory_allocated``: the largest pass since the last reset; ``total_memory``) instead of the
    accelerator's, so it learns and plans as it would on a GPU.

    Use it as a context manager, or call ``install()`` / ``remove()``; it hooks every ``nn.Module``
    of the process while installed. Install it on **every** rank (``ranks`` chooses which raise): on
    the CPU the runtime's out-of-memory agreement runs only while a simulated limit is installed, and
    every rank must take part in it.
    """
    memory = (device_memory_bytes, int(fixed_bytes), int(bytes_per_sample), int(bytes_per_token))
    return SimulatedMemoryLimit(
        max_samples_per_forward, ranks, phase, fail_calls, max_tokens_per_forward, memory=memory
    )
