"""The ``callable`` schedule: a user function ``fn(step, batch_size, **kwargs) -> int``.

The function is the one a Hugging Face-style batch-size scheduler is written as::

    def grow(step: int, batch_size: int, interval: int = 5, increment: int = 1) -> int:
        if step % interval == 0 and step > 0:
            return batch_size + increment
        return batch_size

It is called at every evaluation with the number of completed optimizer steps and its own previous
result (``start`` the first time); the result is remembered, checkpointed, and becomes the next
batch. With ``per: "device"`` both are per-device batches and the global batch is result x world
size, so the function's behaviour does not depend on how many ranks run it.
"""

from __future__ import annotations

import importlib
import inspect
import numbers
from collections.abc import Callable
from typing import Any

from ..config.errors import ConfigError
from .base import ScheduleContext, ScheduleError, check_state

__all__ = ["CallableSchedule", "check_call", "resolve_function", "check_schedule_function"]

_CONFIG_PATH = "adabatch.schedule.function"
_STATE_VERSION = 1


def resolve_function(path: str) -> Callable[..., Any]:
    """Import ``'package.module:name'`` (``name`` may be dotted) and return the callable it names.

    Raises:
        ConfigError: the module cannot be imported, lacks the name, or the object is not callable.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError.single(_CONFIG_PATH, "expected 'package.module:function'", path)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may fail in any way while importing
        raise ConfigError.single(
            _CONFIG_PATH, f"cannot import module {module_name!r} ({type(exc).__name__}: {exc})", path
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError.single(
                _CONFIG_PATH, f"{module_name!r} has no attribute {attr!r} (missing {part!r})", path
            ) from None
    if not callable(obj):
        raise ConfigError.single(_CONFIG_PATH, f"{attr!r} is a {type(obj).__name__}, not callable", path)
    return obj


def check_call(
    fn: Callable[..., Any], kwargs: dict[str, Any], path: str, where: str = "adabatch.schedule.kwargs"
) -> None:
    """Refuse a function that cannot be called as ``fn(step, batch_size, **kwargs)`` (``where``: what
    the error names, the config key or the argument the function came from).

    Raises:
        ConfigError: the arguments do not fit its signature (a misspelt keyword, a function of no
            arguments), naming it; a signature Python cannot read (a builtin) is not checked.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(0, 1, **kwargs)
    except TypeError as err:
        raise ConfigError.single(
            where,
            f"{path} cannot be called as {path.rpartition(':')[2] or path}(step, batch_size"
            + "".join(f", {k}=..." for k in kwargs)
            + f"): {err}; its signature is {signature}",
            kwargs,
        ) from None


def check_schedule_function(schedule: Any) -> None:
    """For a ``callable`` schedule config: import its function and check the call, before any process
    group (``ds_adabatch.initialize``, ``ds-adabatch validate``); other schedules pass.

    Raises:
        ConfigError: the function cannot be imported or called with the configured arguments.
    """
    if getattr(schedule, "type", None) != "callable" or not isinstance(schedule.function, str):
        return
    check_call(resolve_function(schedule.function), dict(schedule.kwargs), schedule.function)


class CallableSchedule:
    """Calls the configured function at every evaluation and remembers its result."""

    name = "callable"
    requires: frozenset[str] = frozenset()
    needs_agreement = True
    """A user's function may answer differently on different ranks (time, files, randomness): the
    runtime applies rank 0's answer everywhere, and its remembered batch with it."""

    def __init__(
        self,
        config: Any,
        function: Callable[..., Any] | None = None,
        *,
        kwargs: dict[str, Any] | None = None,
        path: str | None = None,
        given_as: str = "adabatch.schedule.kwargs",
    ) -> None:
        """``function``, ``kwargs`` and ``path``: the function itself, its keywords and its name where it
        is given as an object (the Trainer's ``batch_size_scheduler``, named by ``given_as`` in errors)
        rather than by the config's import path."""
        self.path = str(config.function) if path is None else path
        self.per = str(config.per)
        self.kwargs = dict(config.kwargs) if kwargs is None else dict(kwargs)
        self.fn = function if function is not None else resolve_function(self.path)
        check_call(self.fn, self.kwargs, self.path, given_as)
        self.current = int(config.start)
        """The function's latest result (``start`` before the first call), in the function's unit."""
        self.last_reason = ""

    @property
    def unit(self) -> str:
        return "samples per device" if self.per == "device" else "global samples"

    def _check(self, result: object, ctx: ScheduleContext) -> int:
        # bool is an int subclass and an integral float still says the function returned the wrong type.
        if isinstance(result, bool) or not isinstance(result, numbers.Integral) or result < 1:
            raise ScheduleError(
                f"batch-size function {self.path} returned {result!r} ({type(result).__name__}) at step "
                f"{ctx.step} for batch_size={self.current}; it must return a positive int "
                f"({self.unit} per optimizer step)"
            )
        return int(result)

    def __call__(self, ctx: ScheduleContext) -> float:
        result = self.fn(ctx.step, self.current, **self.kwargs)
        value = self._check(result, ctx)
        before, self.current = self.current, value
        scale = ctx.world_size if self.per == "device" else 1
        self.last_reason = f"{self.path}(step={ctx.step}, batch_size={before}) -> {value} {self.unit}"
        return float(value * scale)

    def shared_state(self) -> list[int]:
        """What must be equal on every rank after an evaluation: the remembered batch."""
        return [self.current]

    def load_shared_state(self, values: list[int]) -> None:
        (self.current,) = (int(v) for v in values)

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "CallableSchedule",
            "version": _STATE_VERSION,
            "function": self.path,
            "per": self.per,
            "current": self.current,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(state, kind="CallableSchedule", version=_STATE_VERSION)
        if state["per"] != self.per:
            raise ValueError(
                f"the checkpoint's callable schedule counted batches per {state['per']!r}, the config "
                f"now says per {self.per!r}; its remembered batch {state['current']} would change meaning"
            )
        current = state["current"]
        if isinstance(current, bool) or not isinstance(current, int) or current < 1:
            raise ValueError(f"callable schedule state holds an invalid batch {current!r}")
        # The function path is not compared: renaming a module must not make a checkpoint unusable.
        self.current = current
