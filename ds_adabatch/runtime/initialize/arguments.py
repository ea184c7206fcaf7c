"""The arguments of ``ds_adabatch.initialize`` read as ``deepspeed.initialize`` reads them.

DeepSpeed 0.19.8 (``deepspeed/__init__.py``, ``initialize``) takes its config from ``config=``, from the
older ``config_params=``, or from ``args.deepspeed_config`` (``--deepspeed_config`` of
``deepspeed.add_config_arguments``; ``--deepscale_config`` before it), and asserts — after the process
group has formed — when ``args`` carries a config and ``config=`` is given too. ds_adabatch must read the
config itself (it fills the batch keys from the initial plan), so :func:`resolve_call` finds it where
DeepSpeed would, refuses what DeepSpeed would refuse with a sentence before any process group exists, and
hands DeepSpeed a copy of ``args`` without the config (its ``local_rank`` is written back to the caller's
``args`` afterwards, as DeepSpeed does to the object it is given).
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from ...config import ConfigError

__all__ = ["InitializeCall", "ModelParameters", "OptimizerArgument", "SchedulerArgument", "resolve_call"]

# What ``deepspeed.initialize`` 0.19.8 accepts for these arguments (its own annotations, spelled in torch's
# names): an object, or a callable DeepSpeed calls with the parameters / the optimizer.
OptimizerArgument = torch.optim.Optimizer | Callable[[Iterable[Any]], torch.optim.Optimizer]
SchedulerArgument = LRScheduler | Callable[[torch.optim.Optimizer], LRScheduler]
ModelParameters = Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]

# deepspeed.initialize's positional order (0.19.8).
_DEEPSPEED_ORDER = (
    "args",
    "model",
    "optimizer",
    "model_parameters",
    "training_data",
    "lr_scheduler",
    "distributed_port",
    "mpu",
    "dist_init_required",
    "collate_fn",
    "config",
    "mesh_param",
    "config_params",
)
# ds_adabatch's own positional form: initialize(model, config, training_data).
_OWN_ORDER = ("model", "config", "training_data")


@dataclass
class InitializeCall:
    """What ``initialize`` was asked for, with the config resolved."""

    model: torch.nn.Module
    config: str | os.PathLike | dict[str, Any]
    training_data: torch.utils.data.Dataset | None = None
    model_parameters: ModelParameters | None = None
    optimizer: OptimizerArgument | None = None
    lr_scheduler: SchedulerArgument | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    args: argparse.Namespace | None = None
    deepspeed_args: argparse.Namespace | None = None  # what DeepSpeed is given: ``args`` without its config
    deepspeed_kwargs: dict[str, Any] = field(default_factory=dict)

    def report_local_rank(self, local_rank: int) -> None:
        """Set the caller's ``args.local_rank`` as DeepSpeed sets it on the copy it was given."""
        if self.args is not None and hasattr(self.args, "local_rank"):
            self.args.local_rank = local_rank


def resolve_call(positional: tuple[Any, ...], **given: Any) -> InitializeCall:
    """Merge positional and keyword arguments and find the config (see the module docstring)."""
    if positional:
        order = _DEEPSPEED_ORDER if _deepspeed_order(positional) else _OWN_ORDER
        if len(positional) > len(order):
            raise TypeError(
                f"initialize() takes at most {len(order)} positional arguments in this form "
                f"({', '.join(order)}), got {len(positional)}; pass the rest by keyword"
            )
        for name, value in zip(order, positional):
            if name in ("distributed_port", "mesh_param"):
                given.setdefault("_extra", {})[name] = value
                continue
            if given.get(name) is not None:
                raise TypeError(f"initialize() got multiple values for argument {name!r}")
            given[name] = value
    extra = given.pop("_extra", {})
    model = given["model"]
    if model is None:
        raise TypeError("initialize() needs the model to train: pass model=")
    args = given["args"]
    config, deepspeed_args = _find_config(args, given["config"], given["config_params"])
    kwargs = dict(extra)
    for name in ("mpu", "dist_init_required"):
        if given[name] is not None:
            kwargs[name] = given[name]
    return InitializeCall(
        model=model,
        config=config,
        training_data=given["training_data"],
        model_parameters=given["model_parameters"],
        optimizer=given["optimizer"],
        lr_scheduler=given["lr_scheduler"],
        collate_fn=given["collate_fn"],
        args=args,
        deepspeed_args=deepspeed_args,
        deepspeed_kwargs=kwargs,
    )


def _deepspeed_order(positional: tuple[Any, ...]) -> bool:
    """Whether positional arguments follow ``deepspeed.initialize`` (``args, model, ...``) rather than
    ``initialize(model, config, training_data)``: the first is ``None`` or an argparse namespace, or the
    second is the model. Anything else is read as the model, so a wrong model gets the model's error."""
    first = positional[0]
    if isinstance(first, torch.nn.Module):
        return False
    if len(positional) > 1 and isinstance(positional[1], torch.nn.Module):
        return True
    return first is None or isinstance(first, argparse.Namespace)


def _find_config(args: Any, config: Any, config_params: Any) -> tuple[Any, Any]:
    """``(config, args for DeepSpeed)``: the config where DeepSpeed 0.19.8 looks, in its order."""
    if config is None:
        config = config_params  # DeepSpeed: "kept for backwards compatibility"
    from_args = getattr(args, "deepspeed_config", None)
    scale = getattr(args, "deepscale_config", None)
    if scale is not None:
        if from_args is not None:
            raise ConfigError.single(
                "--deepscale_config",
                "both --deepscale_config and --deepspeed_config are given: keep --deepspeed_config "
                "(--deepscale_config is its deprecated name)",
                scale,
            )
        from_args = scale
    if from_args is not None:
        if config is not None:
            raise ConfigError.single(
                "--deepspeed_config",
                f"the DeepSpeed config is given twice, in args.deepspeed_config ({from_args!r}) and as "
                "initialize(config=...): pass one of them (DeepSpeed refuses both as well)",
                from_args,
            )
        config = from_args
    if config is None:
        raise ConfigError.single(
            "config",
            'no DeepSpeed config: pass config= (a path or a dict with an "adabatch" section), or args '
            "with --deepspeed_config (deepspeed.add_config_arguments)",
        )
    if isinstance(config, (str, os.PathLike)):
        config = os.fspath(config)
    deepspeed_args = args
    if args is not None and (hasattr(args, "deepspeed_config") or hasattr(args, "deepscale_config")):
        # DeepSpeed must get the filled config as config= and no config in args (it asserts otherwise);
        # the caller's object is left as it was.
        deepspeed_args = copy.copy(args)
        for name in ("deepspeed_config", "deepscale_config"):
            if hasattr(deepspeed_args, name):
                setattr(deepspeed_args, name, None)
    return config, deepspeed_args
