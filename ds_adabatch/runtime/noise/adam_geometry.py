"""The gradient-noise scale in Adam's geometry: gradients divided by Adam's step denominator.

:class:`AdamPreconditioner` finds, for every model parameter, the second moments DeepSpeed's optimizer
keeps for it (per parameter under ZeRO 0, in flat per-rank partitions under ZeRO 1-3) and turns the
norms :class:`~ds_adabatch.runtime.noise.probe.NoiseProbe` measures into norms of ``g / (sqrt(v_hat) +
eps)``. :func:`measured_geometry` resolves the schedule's ``geometry`` (``auto``/``sgd``/``adam``)
against the engine's optimizer.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ds_adabatch.config import ConfigError
from ds_adabatch.config.schedules import DEFAULT_NOISE_SCALES, GradientNoiseScheduleConfig

from .. import deepspeed_internals as internals

if TYPE_CHECKING:
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    from torch.distributed import ProcessGroup

__all__ = [
    "AdamPreconditioner",
    "check_noise_geometry",
    "configured_geometry",
    "measured_geometry",
    "noise_preconditioner",
]

logger = logging.getLogger("ds_adabatch")

SETTLED_STEPS = 5
"""Adam-geometry measurements start once the optimizer's second moment averages this many steps.

Each coordinate's weight is ``1 / v_hat``, and ``v_hat`` after ``t`` steps is the mean of ``t`` squared
gradients. For gradients with Gaussian noise, ``1 / v_hat`` then has a finite mean only for ``t > 2``
and a finite variance only for ``t > 4``: before that a coordinate whose few gradients happened to be
small gets an unbounded weight. At the first step (``v_hat`` = the step's own squared gradient) the
micro-batches of a coordinate whose halves cancel in the sum weigh up to ``1 / eps^2``, and one such
measurement (10^4-10^5 times the later ones, measured on the main job's model) outweighed the moving
averages for hundreds of measurements. So the first ``SETTLED_STEPS - 1`` optimizer steps are not fed.
"""


class _Unit:
    """One tensor the optimizer keeps state for, and the model parameters it covers.

    ``key``'s ``exp_avg_sq`` elements ``[start, start + size)`` are this rank's piece. When
    ``partitioned``, the unit's full flat is every rank's piece laid end to end in rank order (ZeRO
    1-3); otherwise this rank's piece is the full flat. ``members`` are the model parameters with
    their offset in the full flat.
    """

    __slots__ = ("key", "group", "start", "size", "members", "partitioned")

    def __init__(
        self,
        key: torch.Tensor,
        group: dict[str, Any],
        start: int,
        size: int,
        members: list[tuple[torch.nn.Parameter, int]],
        partitioned: bool,
    ) -> None:
        self.key, self.group, self.start, self.size = key, group, start, size
        self.members, self.partitioned = members, partitioned


def _adam_step_count(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> float:
    """The optimizer steps ``group`` has taken: the largest ``state["step"]`` of its parameters (or the
    group's own ``"step"``, where older FusedAdam states kept it).

    torch Adam/AdamW keep a 0-d CPU tensor in every parameter's state, DeepSpeed's CPUAdam an int. DeepSpeed
    0.19.8's FusedAdam (``deepspeed.ops.adam.fused_adam``) counts in one state only: ``state["step"] += 1``
    follows its loop over the group's parameters, so only the last parameter's count grows and every
    other one stays 0, while the kernel applies that one count to the whole group. Under ZeRO 1-3 a group
    is one flat tensor, so it made no difference; under ZeRO 0 a per-parameter read saw 0 forever.
    """
    count = float(group.get("step", 0))
    for p in group["params"]:
        state = optimizer.state.get(p)
        if state and "step" in state:
            count = max(count, float(state["step"]))
    return count


def _bias_correction(count: float, group: dict[str, Any]) -> float:
    """Adam's ``1 - beta2^t`` after ``count`` steps (1 without bias correction or before any step)."""
    return (
        1.0 - float(group["betas"][1]) ** count if group.get("bias_correction", True) and count > 0 else 1.0
    )


def _is_adam_like(optimizer: torch.optim.Optimizer) -> bool:
    groups = getattr(optimizer, "param_groups", None)
    return bool(groups) and all("betas" in g and "eps" in g for g in groups)


def _group_of(optimizer: torch.optim.Optimizer, key: torch.Tensor) -> dict[str, Any] | None:
    for group in optimizer.param_groups:
        if any(p is key for p in group["params"]):
            return group
    return None


def _numel(p: torch.Tensor) -> int:
    # A ZeRO-3 parameter is empty outside its forward and backward; ds_numel is its full size.
    return int(getattr(p, "ds_numel", p.numel()))


def _offsets(params: Sequence[torch.Tensor]) -> list[int]:
    out, offset = [], 0
    for p in params:
        out.append(offset)
        offset += p.numel()
    return out


def _dp_group_world(group: ProcessGroup | None) -> int:
    dist = torch.distributed
    return dist.get_world_size(group=group) if dist.is_available() and dist.is_initialized() else 1


def _units_for(
    ds_engine: DeepSpeedEngine, basic: torch.optim.Optimizer
) -> tuple[list[_Unit], ProcessGroup | None] | str:
    """The units of the engine's optimizer and the process group its partitions span, or why not.

    Read from DeepSpeed 0.19.8's optimizer wrappers; each reader names the fields it relies on.
    """
    opt = ds_engine.optimizer
    if hasattr(opt, "fp32_partitioned_groups_flat"):
        return _zero3_units(opt, basic)
    if hasattr(opt, "single_partition_of_fp32_groups"):
        return _zero12_units(opt, basic)
    if hasattr(opt, "fp32_groups_flat_partition"):
        return _bf16_units(opt, basic)
    if hasattr(opt, "fp32_groups_flat") and hasattr(opt, "fp16_groups"):
        return _fp16_fused_units(opt, basic)
    if hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups"):
        return _fp16_unfused_units(opt, basic)
    if opt is basic:
        # ZeRO 0 in fp32: the torch optimizer steps the model's own parameters.
        units = []
        for group in basic.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    units.append(_Unit(p, group, 0, p.numel(), [(p, 0)], False))
        return units, None
    return f"the optimizer wrapper {type(opt).__name__} is not one ds_adabatch can read second moments from"


def _zero3_units(
    opt: ZeROOptimizer, basic: torch.optim.Optimizer
) -> tuple[list[_Unit], ProcessGroup | None] | str:
    # ZeRO 3 (stage3.py DeepSpeedZeroOptimizer_Stage3): sub-group s keeps one fp32 flat,
    # fp32_partitioned_groups_flat[s], the concatenation of its parameters' own partitions
    # (fp16_groups[s] order, partition_numel() each). Parameter p is split into equal pieces of
    # partition_numel() elements, rank r holding piece r (_partition_param).
    if getattr(opt, "swap_optimizer", False) or getattr(opt, "backup_optimizer", None) is not None:
        return "ZeRO-3 NVMe or partial optimizer offload keeps part of the state out of reach"
    units, pg = [], None
    for s, params in enumerate(opt.fp16_groups):
        key = opt.fp32_partitioned_groups_flat[s]
        group = basic.param_groups[opt.sub_group_to_group_id[s]]
        offset = 0
        for p in params:
            size = int(p.partition_numel())
            p_group = internals.param_partition_group(opt, p)
            if pg is None:
                pg = p_group
            elif p_group is not pg:
                return "ZeRO-3 parameters are partitioned over different process groups"
            units.append(_Unit(key, group, offset, size, [(p, 0)], True))
            offset += size
    return units, pg


def _zero12_units(
    opt: ZeROOptimizer, basic: torch.optim.Optimizer
) -> tuple[list[_Unit], ProcessGroup | None] | str:
    # ZeRO 1-2 (stage_1_and_2.py DeepSpeedZeroOptimizer): group i's parameters are views into
    # bit16_groups_flat[i] at round_robin_bit16_offsets[i] (round_robin_bit16_groups[i] order); rank r
    # owns elements [r, r + 1) x partition_size[i], whose fp32 copy single_partition_of_fp32_groups[i]
    # the inner optimizer steps.
    units, pg = [], None
    for i, key in enumerate(opt.single_partition_of_fp32_groups):
        group = _group_of(basic, key)
        p_group = opt.real_dp_process_group[i]
        if group is None or (pg is not None and p_group is not pg):
            return "ZeRO 1-2 groups differ from the optimizer's or span different process groups"
        pg = p_group
        members = list(zip(opt.round_robin_bit16_groups[i], opt.round_robin_bit16_offsets[i]))
        units.append(_Unit(key, group, 0, int(opt.partition_size[i]), members, True))
    return units, pg


def _bf16_units(
    opt: ZeROOptimizer, basic: torch.optim.Optimizer
) -> tuple[list[_Unit], ProcessGroup | None] | str:
    # bf16_optimizer.py BF16_Optimizer (bf16 with fp32 gradient accumulation): group i's parameters
    # lie back to back in bf16_groups_flat[i], partitioned like ZeRO 1.
    units, pg = [], None
    for i, key in enumerate(opt.fp32_groups_flat_partition):
        group = _group_of(basic, key)
        p_group = opt.real_dp_process_group[i]
        if group is None or (pg is not None and p_group is not pg):
            return "bf16 optimizer groups differ from the optimizer's or span different process groups"
        pg = p_group
        size = opt.bf16_groups_flat[i].numel() // _dp_group_world(p_group)
        params = opt.bf16_groups[i]
        units.append(_Unit(key, group, 0, size, list(zip(params, _offsets(params))), True))
    return units, pg


def _fp16_fused_units(
    opt: DeepSpeedOptimizer, basic: torch.optim.Optimizer
) -> tuple[list[_Unit], ProcessGroup | None] | str:
    # fp16/fused_optimizer.py FP16_Optimizer: one unpartitioned fp32 flat per group, parameters back
    # to back (torch's _flatten_dense_tensors).
    units = []
    for params, key in zip(opt.fp16_groups, opt.fp32_groups_flat):
        group = _group_of(basic, key)
        if group is None:
            return "fp16 optimizer groups differ from the optimizer's"
        units.append(_Unit(key, group, 0, key.numel(), list(zip(params, _offsets(params))), False))
    return units, None


def _fp16_unfused_units(
    opt: DeepSpeedOptimizer, basic: torch.optim.Optimizer
) -> tuple[list[_Unit], ProcessGroup | None] | str:
    # fp16/unfused_optimizer.py FP16_UnfusedOptimizer (ZeRO 0 with fp16 or bf16): one fp32 master per
    # parameter, fp32_groups[i][j] for fp16_groups[i][j].
    units = []
    for params, masters in zip(opt.fp16_groups, opt.fp32_groups):
        for p, key in zip(params, masters):
            group = _group_of(basic, key)
            if group is None:
                return "fp16 optimizer groups differ from the optimizer's"
            units.append(_Unit(key, group, 0, key.numel(), [(p, 0)], False))
    return units, None


def _own_slices(units: Sequence[_Unit], rank: int, world: int) -> list[tuple[_Unit, int, int, int]]:
    """(unit, start in its state, size, offset in its full flat) of what rank ``rank`` weighs.

    A partitioned unit's piece is the rank's own partition. Unpartitioned units (every rank holds the
    whole state, ZeRO 0) are laid end to end and cut into ``world`` equal consecutive pieces, rank ``r``
    taking piece ``r``, as ZeRO 1-2 partition their flat groups: every coordinate is weighed on exactly
    one rank either way, and each rank hooks and weighs only the parameters its piece touches.
    """
    total = sum(u.size for u in units if not u.partitioned)
    chunk = -(-total // world) if total else 0
    lo, hi = rank * chunk, min(total, (rank + 1) * chunk)
    out, pos = [], 0
    for unit in units:
        if unit.partitioned:
            out.append((unit, unit.start, unit.size, rank * unit.size))
            continue
        a, b = max(lo, pos) - pos, min(hi, pos + unit.size) - pos
        if a < b:
            out.append((unit, unit.start + a, b - a, a))
        pos += unit.size
    return out


class AdamPreconditioner:
    """The noise-scale norms in Adam's geometry: gradients divided elementwise by ``sqrt(v_hat) + eps``.

    ``v_hat`` is the optimizer's bias-corrected second moment ``exp_avg_sq / (1 - beta2^t)`` right after
    the measured step's update, i.e. the denominator of the step Adam actually takes (it includes
    this step's gradient, which bounds every coordinate's weight as Adam bounds its step; the moments
    of the previous step leave rarely-seen coordinates with unbounded weights, and the estimate
    scatters over orders of magnitude). Since that denominator exists only after the step, the
    backward hooks add each micro-batch's squared gradient into a per-coordinate buffer
    (:meth:`accumulate`), and a post-step hook on the inner optimizer (:meth:`after_step`) weighs it
    with ``1 / (sqrt(v_hat) + eps)^2``, together with the reduced gradient the optimizer stepped with.

    **Every rank weighs one share of the coordinates, with its own micro-batches**, so a measured step
    holds 1/world of a model's worth of fp32 values and issues no collective beyond the step's existing
    all-reduce of a few scalars. The shares (DeepSpeed 0.19.8):

    * ZeRO 1-2 (and bf16 with fp32 accumulation): the flat fp32 partition per group the rank steps.
    * ZeRO 3: the rank's piece of every parameter.
    * ZeRO 0 (state per parameter, or per fp32 master copy under fp16/bf16, on every rank): the
      parameters laid end to end and cut into ``world`` equal consecutive pieces, as ZeRO 1-2 cut
      their flat groups.

    The small-batch norm is then the sum over shares of each share's mean over its rank's
    micro-batches. Micro-batches are drawn alike on every rank, so this has the expected value of the
    mean over all micro-batches; it averages fewer micro-batches per coordinate, so one step's
    estimate scatters more (the schedule's moving averages smooth that), and a step in which a rank
    that holds a share ran only padding is not measured.

    The reduced gradient's norms are taken on the optimizer's own gradient, over the same shares,
    which DeepSpeed has unscaled and clipped by one factor for all coordinates: the ratio of its
    weighted to its plain squared norm is that of the unclipped gradient, and the probe multiplies it
    into the plain squared norm it measures anyway. Build it with :meth:`for_deepspeed`.
    """

    def __init__(
        self,
        units: list[_Unit],
        optimizer: torch.optim.Optimizer,
        process_group: ProcessGroup | None,
        device: torch.device | str,
        *,
        rank: int | None = None,
        world: int | None = None,
    ) -> None:
        dist = torch.distributed
        on = dist.is_available() and dist.is_initialized()
        if world is None:
            world = dist.get_world_size(group=process_group) if on else 1
        if rank is None:
            rank = dist.get_rank(group=process_group) if on else 0
        self.optimizer = optimizer
        self.device = torch.device(device)
        # id(parameter) -> [(first, end) of its flattened gradient, where it goes in the buffer]
        self._pieces: dict[int, list[tuple[int, int, int]]] = {}
        # id(stepped tensor) -> [(start in its state, size, offset in the buffer)], slices merged where
        # both the state and the buffer run on (ZeRO 3's per-parameter pieces of one flat).
        self._runs: dict[int, list[list[int]]] = {}
        at = 0
        for unit, start, size, flat_lo in _own_slices(units, rank, world):
            # The slice is the unit's state [start, start + size), its full flat [flat_lo, flat_lo + size)
            # (the frame of its members' offsets) and the buffer [at, at + size).
            for p, offset in unit.members:
                lo, hi = max(offset, flat_lo), min(offset + _numel(p), flat_lo + size)
                if lo < hi:
                    self._pieces.setdefault(id(p), []).append((lo - offset, hi - offset, at + lo - flat_lo))
            runs = self._runs.setdefault(id(unit.key), [])
            if runs and runs[-1][0] + runs[-1][1] == start and runs[-1][2] + runs[-1][1] == at:
                runs[-1][1] += size
            else:
                runs.append([start, size, at])
            at += size
        self._size = at
        self._buffer: torch.Tensor | None = None
        self.unsettled = False
        """Whether the last :meth:`after_step` found the second moments too young to weigh by
        (:data:`SETTLED_STEPS`); the probe then reports its step as not measured."""

    @classmethod
    def for_deepspeed(cls, ds_engine: DeepSpeedEngine) -> AdamPreconditioner | None:
        """The preconditioner of ``ds_engine``'s optimizer; None (with a warning) where its second
        moments cannot be read.

        Raises:
            ConfigError: the optimizer is not Adam-like (no ``betas`` and ``eps``).
        """
        basic = _inner_optimizer(ds_engine)
        check_noise_geometry(basic, "adam")
        found = _units_for(ds_engine, basic)
        if isinstance(found, str):
            logger.warning(
                'gradient_noise geometry "adam": %s; measuring the noise scale in geometry "sgd"', found
            )
            return None
        units, group = found
        # The probe's sums are added over all ranks: the shares must cover every rank exactly once.
        world = _dp_group_world(None)
        if group is not None and _dp_group_world(group) != world:
            logger.warning(
                'gradient_noise geometry "adam": the optimizer state is partitioned over %d of the %d '
                'ranks; measuring the noise scale in geometry "sgd"',
                _dp_group_world(group),
                world,
            )
            return None
        return cls(units, basic, group, ds_engine.device)

    @property
    def holds_share(self) -> bool:
        """Whether this rank weighs any coordinates (it has a share of the state)."""
        return self._size > 0

    def measures(self, param: torch.nn.Parameter) -> bool:
        """Whether any of ``param``'s coordinates are weighed on this rank (its gradient needs a hook)."""
        return id(param) in self._pieces

    def begin_step(self) -> None:
        """A zeroed buffer for one measured step (one fp32 value per coordinate of this rank's share)."""
        self._buffer = torch.zeros(self._size, dtype=torch.float32, device=self.device)

    def accumulate(self, param: torch.nn.Parameter, grad: torch.Tensor, factor: float) -> None:
        """Add ``factor x grad^2`` (one micro-batch's full gradient of ``param``) into the buffer, for
        the coordinates of this rank's share."""
        pieces = self._pieces.get(id(param))
        if pieces is None:
            return  # a parameter the optimizer does not step, or none of it in this rank's share
        flat = grad.detach().reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        buffer = self._buffer
        for first, end, at in pieces:
            x = flat[first:end]
            buffer[at : at + end - first].addcmul_(x, x, value=factor)

    def after_step(self, optimizer: torch.optim.Optimizer, out: torch.Tensor) -> None:
        """A post-step hook on the inner optimizer: add, over this rank's share, the weighted squared
        norms of its micro-batches (into ``out[0]``) and the reduced gradient's weighted and plain
        squared norms (``out[1:3]``)."""
        parts: list[torch.Tensor] = []
        self.unsettled = False
        for group in optimizer.param_groups:
            count: float | None = None  # the group's step count, read once (_adam_step_count)
            for t in group["params"]:
                runs = self._runs.get(id(t))
                state = optimizer.state.get(t)
                if runs is None or t.grad is None or not state:
                    continue
                if count is None:
                    count = _adam_step_count(optimizer, group)
                if count < SETTLED_STEPS:
                    self.unsettled = True  # the step is not fed (SETTLED_STEPS)
                    return
                v = state.get("exp_avg_sq")
                if v is None:
                    raise ValueError(
                        f'gradient_noise geometry "adam": the optimizer {type(optimizer).__name__} keeps '
                        f"no exp_avg_sq (its state has {sorted(state)}); set adabatch.schedule.geometry "
                        'to "sgd" or use an Adam-type optimizer'
                    )
                v, g = v.detach().reshape(-1), t.grad.detach().reshape(-1)
                # Adam's denominator after the update, sqrt(v_hat) + eps with v_hat = v / (1 - beta2^t).
                root_correction = _bias_correction(count, group) ** -0.5
                eps = float(group["eps"])
                for start, size, at in runs:
                    denom = v[start : start + size].float().sqrt().mul_(root_correction).add_(eps)
                    gs = g[start : start + size].float()
                    weighted = gs / denom
                    w2 = denom.square_().reciprocal_()
                    if w2.device != self.device:  # optimizer state offloaded to the CPU
                        w2 = w2.to(self.device, non_blocking=True)
                    small = torch.dot(self._buffer[at : at + size], w2)
                    parts += [
                        small,
                        torch.dot(weighted, weighted).to(self.device),
                        torch.dot(gs, gs).to(self.device),
                    ]
        if parts:
            out.add_(torch.stack(parts).view(-1, 3).sum(0).to(out.dtype))

    def release(self) -> None:
        """Drop the buffer until the next :meth:`begin_step`."""
        self._buffer = None


def check_noise_geometry(optimizer: torch.optim.Optimizer, geometry: str) -> None:
    """Refuse ``geometry: "adam"`` for an optimizer without Adam's second moment.

    Raises:
        ConfigError: ``geometry`` is ``"adam"`` and ``optimizer``'s parameter groups have no ``betas``
            and ``eps`` (SGD, Adagrad, Lion, ...).
    """
    if geometry == "adam" and not _is_adam_like(optimizer):
        raise ConfigError.single(
            "adabatch.schedule.geometry",
            f"measures the noise scale with Adam's second moment, but the optimizer "
            f"{type(optimizer).__name__} keeps none (no betas and eps in its parameter groups); set it "
            'to "sgd" or train with an Adam-type optimizer',
            geometry,
        )


def measured_geometry(ds_engine: DeepSpeedEngine, geometry: str, *, caller_resolves: bool = True) -> str:
    """The geometry a probe on ``ds_engine`` measures in for the configured ``geometry``.

    ``"auto"`` is ``"adam"`` for an optimizer that keeps Adam's second moment, else ``"sgd"``;
    ``"adam"`` falls back to ``"sgd"`` (with a warning) where DeepSpeed's optimizer wrapper keeps the
    second moments out of reach. ``caller_resolves``: the caller sets the schedule's scale for the
    result (the engine); else an ``"auto"`` that resolves to ``"sgd"`` is warned about once, since the
    schedule then keeps the adam geometry's default ``scale``.

    Raises:
        ConfigError: ``geometry`` is ``"adam"`` and the optimizer keeps no second moment.
    """
    if geometry == "sgd":
        return "sgd"
    if geometry == "auto" and not _is_adam_like(_inner_optimizer(ds_engine)):
        if not caller_resolves and ds_engine not in _AUTO_WARNED:
            _AUTO_WARNED.add(ds_engine)
            logger.warning(
                'gradient_noise geometry "auto": the optimizer %s keeps no second moment, so the noise '
                'scale is measured in geometry "sgd" while scale keeps the adam default %g; set '
                'geometry "sgd" (its default scale is %g) or set scale',
                type(_inner_optimizer(ds_engine)).__name__,
                DEFAULT_NOISE_SCALES["adam"],
                DEFAULT_NOISE_SCALES["sgd"],
            )
        return "sgd"
    return "adam" if noise_preconditioner(ds_engine) is not None else "sgd"


def _inner_optimizer(ds_engine: DeepSpeedEngine) -> torch.optim.Optimizer:
    # DeepSpeed 0.19.8 keeps the torch optimizer it wraps in engine.basic_optimizer (a ZeRO or
    # fp16/bf16 wrapper holds the same object as .optimizer).
    basic = getattr(ds_engine, "basic_optimizer", None) or getattr(ds_engine.optimizer, "optimizer", None)
    return basic if basic is not None else ds_engine.optimizer


_AUTO_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()


def configured_geometry(ds_engine: DeepSpeedEngine) -> str:
    """The ``geometry`` of the ``gradient_noise`` schedule in the engine's DeepSpeed config (its
    ``"adabatch"`` section), ``"sgd"`` without one."""
    # The config dict the engine was built with, unknown sections such as "adabatch" included. The
    # Hugging Face Trainer path reads its schedule from that same section.
    raw = internals.raw_config(ds_engine)
    section = raw.get("adabatch") if isinstance(raw, dict) else None
    schedule = section.get("schedule") if isinstance(section, dict) else None
    if not isinstance(schedule, dict) or schedule.get("type") not in ("gradient_noise", "goodput"):
        return "sgd"
    return str(schedule.get("geometry", GradientNoiseScheduleConfig.model_fields["geometry"].default))


_PRECONDITIONERS: weakref.WeakKeyDictionary[Any, AdamPreconditioner | None] = weakref.WeakKeyDictionary()


def noise_preconditioner(ds_engine: DeepSpeedEngine) -> AdamPreconditioner | None:
    """The engine's :class:`AdamPreconditioner`, built once (None where the second moments cannot be
    read: the noise scale is then measured in the SGD geometry, with one warning).

    Raises:
        ConfigError: the optimizer is not Adam-like.
    """
    if ds_engine not in _PRECONDITIONERS:
        _PRECONDITIONERS[ds_engine] = AdamPreconditioner.for_deepspeed(ds_engine)
    return _PRECONDITIONERS[ds_engine]
