"""ZeRO 3 in live elasticity: what a rank's snapshot holds, and the way back to a rebuilt engine.

Under ZeRO 3 (DeepSpeed 0.19.8 ``DeepSpeedZeroOptimizer_Stage3``) the parameters are partitioned too:
each rank holds, per parameter, one slice of the flattened value (``partition size`` elements from
``rank x partition size``, the last one padded) in its ``ds_tensor``, and the fp32 master copy of the
same slice inside a flat fp32 sub-group (``fp32_partitioned_groups_flat``) whose optimizer state
(Adam's ``exp_avg``, ``exp_avg_sq``) is keyed by that flat tensor. A snapshot's *unit* is one such flat
sub-group and its *pieces* the parameters' slices in it (padding left out), so the buddy copy, the
agreement and :func:`~.live_snapshot.assemble` are those of ZeRO 1 and 2: every survivor ends with each
parameter's full fp32 value and moments.

After a lost peer the model is still partitioned over the failed world: its parameters are empty and
every module's parameters all-gather on access, which a world with a dead member cannot do.
:func:`unpartition_model` gives every parameter its whole value from the assembled snapshot and removes
what ZeRO 3 put on the model (no collective), so that the same ``deepspeed.initialize`` partitions it
afresh over the new world; :func:`restore_zero3` then writes each rank's new slices into the fp32
sub-groups, the optimizer state and the ``ds_tensor`` partitions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import deepspeed_internals as internals
from .units import Assembled, Piece, Unit

if TYPE_CHECKING:
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.engine import DeepSpeedEngine

__all__ = ["full_shapes", "restore_zero3", "unpartition_model", "zero3_problem", "zero3_units"]

_WEIGHTS = "fp32"


def full_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    """Every parameter's whole shape, ZeRO 3 partitioned ones included (their ``ds_shape``)."""
    return {n: getattr(p, "ds_shape", p.shape) for n, p in model.named_parameters()}


def zero3_problem(ds_engine: DeepSpeedEngine) -> str | None:
    """Why snapshots cannot capture this ZeRO 3 engine (None: they can)."""
    opt = ds_engine.optimizer
    if not hasattr(opt, "fp32_partitioned_groups_flat"):
        return f"ZeRO stage 3 with the optimizer wrapper {type(opt).__name__}"
    if getattr(opt, "offload_optimizer", False) or getattr(opt, "offload_param", False):
        return "ZeRO stage 3 offload (offload_optimizer / offload_param: the partitions live off the engine)"
    held = {id(p) for group in opt.fp16_groups for p in group}
    if any(id(p) not in held for p in ds_engine.module.parameters()):
        return "ZeRO stage 3 with parameters the optimizer does not hold (frozen ones have no fp32 copy)"
    if int(ds_engine.zero_hpz_partition_size()) > 1:
        return "ZeRO stage 3 with hpZ (zero_hpz_partition_size > 1: a secondary partition per node)"
    world = torch.distributed.get_world_size()
    for group in opt.fp16_groups:
        if (
            group
            and torch.distributed.get_world_size(internals.param_partition_group(opt, group[0])) != world
        ):
            return "ZeRO stage 3 partitioned over a sub-group (MiCS); partition over the whole world"
    return None


def _slices(opt: ZeROOptimizer) -> list[tuple[torch.Tensor, list[tuple[torch.nn.Parameter, int, int, int]]]]:
    """Per flat sub-group: (parameter, start in the flattened parameter, elements, start in the flat)
    of this rank's partition, padding left out."""
    out = []
    for flat, placed in internals.zero3_partitions(opt):
        rows = []
        for p, offset, size in placed:
            rank = torch.distributed.get_rank(internals.param_partition_group(opt, p))
            start = rank * size
            numel = max(0, min(size, p.ds_numel - start))
            if numel:
                rows.append((p, start, numel, offset))
        out.append((flat, rows))
    return out


def zero3_units(ds_engine: DeepSpeedEngine, names: dict[torch.Tensor, str]) -> tuple[list[Unit], int, int]:
    """(units, partition id, partitions) of this rank under ZeRO 3 (see the module docstring)."""
    opt = ds_engine.optimizer
    units = []
    for flat, rows in _slices(opt):
        pieces = [Piece(names[p], start, numel, offset) for p, start, numel, offset in rows]
        units.append(Unit(flat, opt.optimizer, pieces))
    return units, torch.distributed.get_rank(), torch.distributed.get_world_size()


def unpartition_model(model: torch.nn.Module, state: Assembled) -> None:
    """The model of a failed ZeRO 3 world back to plain, whole parameters from the assembled snapshot."""
    internals.unpartition_zero3_model(model, {name: entry[_WEIGHTS] for name, entry in state.full.items()})


def restore_zero3(ds_engine: DeepSpeedEngine, state: Assembled, keys: list[str], step_value: Any) -> None:
    """Write an assembled snapshot into a freshly built ZeRO 3 engine of any data-parallel size: this
    rank's slices of the fp32 master weights, of the optimizer state and of the ``ds_tensor``s."""
    opt = ds_engine.optimizer
    base = opt.optimizer
    names = {p: n for n, p in ds_engine.module.named_parameters()}
    with torch.no_grad():
        for flat, rows in _slices(opt):
            moments = {k: torch.zeros_like(flat) for k in keys}
            for p, start, numel, offset in rows:
                entry = state.full[names[p]]
                value = entry[_WEIGHTS].view(-1).narrow(0, start, numel)
                flat.narrow(0, offset, numel).copy_(value)
                # The low-precision partition the forward gathers (a view into the flat fp16 group).
                p.ds_tensor.data.view(-1).narrow(0, 0, numel).copy_(value)
                if p.data.numel() == p.ds_numel:
                    # Gathered already (a persistent parameter, below stage3_param_persistence_threshold,
                    # stays whole between passes): its whole value too.
                    p.data.copy_(entry[_WEIGHTS].view(p.data.shape))
                for k in keys:
                    moments[k].narrow(0, offset, numel).copy_(entry[k].view(-1).narrow(0, start, numel))
            if keys:
                # The optimizer creates its state lazily at the first step: here it is given whole.
                count = step_value.clone() if torch.is_tensor(step_value) else step_value
                base.state[flat] = {**moments, "step": count}
