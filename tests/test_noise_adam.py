"""The gradient-noise scale in Adam's geometry (``gradient_noise.geometry: "adam"``).

One process: the probe's weighted norms against a hand computation from a torch AdamW's state, the
per-rank shares of partitioned and unpartitioned state (every coordinate weighed on exactly one rank),
the estimator's big-norm ratio, config errors. Two gloo ranks (one launch, this file run as a torchrun
worker): under ZeRO 0, 1, 2 and 3 the estimates equal a plain-PyTorch reference that weighs each
coordinate on the rank DeepSpeed's layout gives it, with that rank's micro-batches, and the parameters
equal the reference's (the probe does not touch the update).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from ds_adabatch.config import ConfigError
from ds_adabatch.config.schedules import GradientNoiseScheduleConfig
from ds_adabatch.runtime.noise.adam_geometry import (
    SETTLED_STEPS,
    AdamPreconditioner,
    _Unit,
    check_noise_geometry,
    configured_geometry,
)
from ds_adabatch.runtime.noise.probe import NoiseProbe, update_estimator
from ds_adabatch.signals import GradientNoiseEstimator

ROOT = Path(__file__).resolve().parents[1]
STAGES = (0, 1, 2, 3)
STEPS = SETTLED_STEPS + 3
CLIP = 0.05  # small enough that DeepSpeed clips every step: the big norm must be taken before it


# ---------------------------------------------------------------------------------------------------
# One process


def _model(seed: int = 0) -> torch.nn.Module:
    # 7 x 5 + 7 + 7 + 1 = 50 parameters: sizes that do not divide evenly by two ranks (ZeRO-3 padding)
    # and parameters that straddle the ZeRO 1-2 partition boundary.
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))


def _data(n: int = 64, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randn(n, 1, generator=g)


def _grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _inverse_roots(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Adam's 1 / (sqrt(v_hat) + eps) per parameter, written out from the state."""
    out = []
    group = opt.param_groups[0]
    beta2, eps = group["betas"][1], group["eps"]
    for p in group["params"]:
        st = opt.state[p]
        t = float(st["step"])
        out.append(1.0 / ((st["exp_avg_sq"] / (1 - beta2**t)).sqrt() + eps))
    return out


def _plain_preconditioner(model: torch.nn.Module, opt: torch.optim.Optimizer) -> AdamPreconditioner:
    units = [_Unit(p, opt.param_groups[0], 0, p.numel(), [(p, 0)], False) for p in model.parameters()]
    return AdamPreconditioner(units, opt, None, "cpu")


def test_adam_norms_match_a_hand_computation_from_the_optimizer_state():
    model = _model()
    x, y = _data()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-3)
    pre = _plain_preconditioner(model, opt)
    sizes = [(0, 4), (4, 10)]
    for step in range(SETTLED_STEPS + 1):
        lo_hi = [(lo + 10 * (step % 6), hi + 10 * (step % 6)) for lo, hi in sizes]
        micro = [_grads(model, x[lo:hi], y[lo:hi]) for lo, hi in lo_hi]
        model.zero_grad()
        probe = NoiseProbe(model.parameters(), "cpu", preconditioner=pre)
        for lo, hi in lo_hi:  # each backward weighted as the engine does
            weight = (hi - lo) / 10
            probe.begin(weight, hi - lo)
            ((model(x[lo:hi]) - y[lo:hi]) ** 2).mean().mul(weight).backward()
            probe.end()
        big = [p.grad.detach().clone() for p in model.parameters()]
        # Clip as DeepSpeed does before the inner step: the optimizer steps with a scaled gradient.
        for p in model.parameters():
            p.grad.mul_(0.25)
        opt.step()
        probe.close()
        inv = _inverse_roots(opt)  # Adam's denominator of the step just taken

        mean_small, n, inv_b, weighted, plain, missing = (float(v) for v in probe.local_sums())
        if step + 1 < SETTLED_STEPS:  # v_hat of fewer steps: reported as not measured, not fed
            assert pre.unsettled and missing == 1 and weighted == 0 and plain == 0, f"step {step + 1}"
            continue
        assert not pre.unsettled
        expected_small = sum(float(((gi * w) ** 2).sum()) for g in micro for gi, w in zip(g, inv)) / 2
        expected_weighted = sum(float(((g * w) ** 2).sum()) for g, w in zip(big, inv))
        expected_plain = sum(float((g**2).sum()) for g in big)
        assert n == 2 and inv_b == pytest.approx(1 / 4 + 1 / 6) and missing == 0
        assert mean_small == pytest.approx(expected_small, rel=1e-5), (
            f"step {step}: small-batch weighted norms"
        )
        # The post-step hook saw the clipped gradient: both of its sums scale by 0.25^2, their ratio not.
        assert weighted == pytest.approx(expected_weighted * 0.0625, rel=1e-5), f"step {step}: weighted"
        assert plain == pytest.approx(expected_plain * 0.0625, rel=1e-5), f"step {step}: plain"
        assert pre._buffer is None, "close() must drop the buffer"


def test_update_estimator_scales_the_big_norm_by_the_weighted_ratio():
    est = GradientNoiseEstimator(ema_beta=0.0)
    # Adam's geometry: (mean small-batch norm, micro-batches, sum of 1/size, weighted, plain, missing).
    update_estimator(est, [3.0, 2, 2 / 4, 10.0, 5.0, 0.0], 16, 1.5)
    ref = GradientNoiseEstimator(ema_beta=0.0)
    ref.update(4, 3.0, 16, 3.0)  # 1.5 x 10 / 5
    assert est.last_grad_sq_norm == pytest.approx(ref.last_grad_sq_norm)
    assert est.last_trace_sigma == pytest.approx(ref.last_trace_sigma)
    # A step the optimizer skipped (no gradient reached it) is not fed.
    update_estimator(est, [3.0, 2, 0.5, 0.0, 0.0, 0.0], 16, 1.5)
    assert est.count == 1
    # Nor is one where a rank that holds a share of the coordinates ran only padding.
    update_estimator(est, [3.0, 2, 0.5, 10.0, 5.0, 1.0], 16, 1.5)
    assert est.count == 1


def _shares_total(units_of_rank, grads: dict, world: int) -> tuple[float, float]:
    """Sum over ranks of the probe's weighted small-batch norm (one micro-batch, weight 1) and of the
    reduced weighted norm, each rank with its own preconditioner."""
    small = weighted = 0.0
    for rank in range(world):
        units, opt = units_of_rank(rank)
        pre = AdamPreconditioner(units, opt, None, "cpu", rank=rank, world=world)
        pre.begin_step()
        for p, g in grads.items():
            pre.accumulate(p, g, 1.0)
        out = torch.zeros(3, dtype=torch.float64)
        pre.after_step(opt, out)
        small += float(out[0])
        weighted += float(out[1])
    return small, weighted


def _stepped(keys: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> torch.optim.Optimizer:
    """An AdamW that has taken SETTLED_STEPS steps with the same gradients (so v_hat = grad^2)."""
    opt = torch.optim.AdamW(keys, lr=0.01, betas=(0.9, 0.99), eps=1e-3)
    for _ in range(SETTLED_STEPS):
        for k, g in zip(keys, grads):
            k.grad = g.clone()
        opt.step()
    return opt


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_every_coordinate_is_weighed_on_exactly_one_rank(world):
    gen = torch.Generator().manual_seed(world)
    shapes = [(5,), (7, 1), (4,)]  # 16 elements: padding and parameters across partition boundaries
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    micro = {p: torch.randn(p.shape, generator=gen) for p in params}
    flat_grad = torch.randn(16, generator=gen)  # the reduced gradient the optimizer steps with

    # Unpartitioned (ZeRO 0): every rank steps full per-parameter state; the shares are consecutive.
    masters = [torch.nn.Parameter(torch.zeros(p.numel())) for p in params]
    full_opt = _stepped(masters, list(flat_grad.split([5, 7, 4])))
    inv = [1 / ((full_opt.state[m]["exp_avg_sq"] / (1 - 0.99**SETTLED_STEPS)).sqrt() + 1e-3) for m in masters]
    expected_small = sum(float((micro[p].reshape(-1) * w).square().sum()) for p, w in zip(params, inv))
    expected_weighted = float((flat_grad * torch.cat(inv)).square().sum())

    def unpartitioned(rank):
        group = full_opt.param_groups[0]
        return [_Unit(m, group, 0, m.numel(), [(p, 0)], False) for p, m in zip(params, masters)], full_opt

    small, weighted = _shares_total(unpartitioned, micro, world)
    assert small == pytest.approx(expected_small, rel=1e-5)
    assert weighted == pytest.approx(expected_weighted, rel=1e-5)

    # Partitioned (ZeRO 1-2): one flat, padded to world x width, rank r steps elements [r, r+1) x width.
    width = -(-16 // world)
    padded = torch.cat([flat_grad, torch.zeros(world * width - 16)])
    parts = [torch.nn.Parameter(torch.zeros(width)) for _ in range(world)]
    opts = [_stepped([k], [padded[r * width : (r + 1) * width]]) for r, k in enumerate(parts)]
    inv = torch.cat(
        [
            1 / ((o.state[k]["exp_avg_sq"] / (1 - 0.99**SETTLED_STEPS)).sqrt() + 1e-3)
            for o, k in zip(opts, parts)
        ]
    )
    micro_flat = torch.cat([micro[p].reshape(-1) for p in params])
    members = list(zip(params, (0, 5, 12)))

    def partitioned(rank):
        unit = _Unit(parts[rank], opts[rank].param_groups[0], 0, width, members, True)
        return [unit], opts[rank]

    small, weighted = _shares_total(partitioned, micro, world)
    assert small == pytest.approx(float((micro_flat * inv[:16]).square().sum()), rel=1e-5)
    assert weighted == pytest.approx(float((flat_grad * inv[:16]).square().sum()), rel=1e-5)


def test_adam_geometry_needs_an_adam_like_optimizer():
    model = _model()
    with pytest.raises(ConfigError) as err:
        check_noise_geometry(torch.optim.SGD(model.parameters(), lr=0.1), "adam")
    assert "adabatch.schedule.geometry" in str(err.value) and "SGD" in str(err.value)
    check_noise_geometry(torch.optim.SGD(model.parameters(), lr=0.1), "sgd")
    check_noise_geometry(torch.optim.Adam(model.parameters()), "adam")


def test_configured_geometry_reads_the_engines_adabatch_section():
    from types import SimpleNamespace

    def engine(section):
        return SimpleNamespace(_config=SimpleNamespace(_param_dict={"adabatch": section}))

    noise = {"type": "gradient_noise", "start": 8}
    assert configured_geometry(engine({"schedule": {**noise, "geometry": "adam"}})) == "adam"
    assert configured_geometry(engine({"schedule": {**noise, "geometry": "sgd"}})) == "sgd"
    default = GradientNoiseScheduleConfig.model_fields["geometry"].default
    assert configured_geometry(engine({"schedule": noise})) == default
    assert configured_geometry(engine({"schedule": {"type": "constant", "value": 8}})) == "sgd"
    assert configured_geometry(SimpleNamespace()) == "sgd"


def test_geometry_is_validated_by_the_config():
    cfg = GradientNoiseScheduleConfig.model_validate(
        {"type": "gradient_noise", "start": 8, "geometry": "adam"}
    )
    assert cfg.geometry == "adam"
    with pytest.raises(ValueError, match="geometry"):
        GradientNoiseScheduleConfig.model_validate({"type": "gradient_noise", "start": 8, "geometry": "lamb"})


# ---------------------------------------------------------------------------------------------------
# Two ranks, ZeRO 0-3 (this file is the torchrun worker)


def test_zero_stages_agree_with_plain_torch(tmp_path):
    from _util import torchrun

    proc = torchrun(Path(__file__), str(tmp_path), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    doc = json.loads((tmp_path / "adam_geometry.json").read_text())
    for stage in STAGES:
        ref = doc[f"reference{stage}"]
        measured = STEPS - (SETTLED_STEPS - 1)
        assert len(ref["estimates"]) == measured
        got = doc[f"zero{stage}"]
        assert got["count"] == measured, f"ZeRO {stage}: {got['count']} measurements, expected {measured}"
        for step, (mine, theirs) in enumerate(zip(got["estimates"], ref["estimates"])):
            for name, a, b in zip(("|G|^2", "tr(Sigma)"), mine, theirs):
                assert a == pytest.approx(b, rel=1e-4), (
                    f"ZeRO {stage} step {step}: {name} {a} != reference {b}"
                )
        for name in ("grad_sq_norm", "trace_sigma"):  # the smoothed averages B_noise is the ratio of
            assert got[name] == pytest.approx(ref[name], rel=1e-4), f"ZeRO {stage}: smoothed {name}"
        diff = max(abs(a - b) for a, b in zip(got["params"], ref["params"]))
        assert diff < 1e-5, f"ZeRO {stage}: parameters differ from plain AdamW by {diff} (the update changed)"
    # Each rank weighs its own share with its own micro-batches: the estimate differs from the one that
    # weighs every coordinate with every micro-batch (so the test's ownership is really exercised).
    pooled = doc["pooled"]
    for stage in STAGES:
        ref = doc[f"reference{stage}"]
        assert abs(ref["trace_sigma"] / pooled["trace_sigma"] - 1) > 1e-3, (
            f"ZeRO {stage}: shares not exercised"
        )
    # DeepSpeed's FusedAdam keeps the step count in its group's last parameter's state only (every other
    # state says 0): the geometry still reads the group's count, so the steps are measured once the
    # second moments have settled, and equal the plain-AdamW reference of the same micro-batches.
    fused, ref = doc["zero0_fused"], doc["referencefused"]
    assert fused["count"] == STEPS - (SETTLED_STEPS - 1), f"FusedAdam, ZeRO 0: {fused['count']} measurements"
    for name in ("grad_sq_norm", "trace_sigma"):
        assert fused[name] == pytest.approx(ref[name], rel=1e-3), f"FusedAdam, ZeRO 0: smoothed {name}"
    # The SGD-geometry run of the same steps: a different estimate, so the geometry is really applied.
    sgd = doc["zero2_sgd"]
    assert abs(sgd["trace_sigma"] / doc["reference2"]["trace_sigma"] - 1) > 1e-2, (
        "adam and sgd geometries agree"
    )
    with_sgd = doc["sgd_optimizer"]
    error = with_sgd["adam"].get("error", "")
    assert "adabatch.schedule.geometry" in error and "SGD" in error, f"SGD with geometry adam: {with_sgd}"
    assert with_sgd["auto"] == {"geometry": "sgd", "scale": 0.5}, f"SGD with geometry auto: {with_sgd}"


def _ds_config(stage: int, geometry: str, torch_adam: bool = True) -> dict:
    """AdamW (torch's, or DeepSpeed's FusedAdam), clipping on, batch 8 = 2 ranks x micro 2 x GAS 2 held;
    ``geometry`` "auto" is left unset."""
    return {
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 0.01,
                "betas": [0.9, 0.99],
                "eps": 1e-3,
                "weight_decay": 0.0,
                "torch_adam": torch_adam,
            },
        },
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
        "adabatch": {
            # Batch 8 = 2 ranks x micro 2 x GAS 2; the long warm-up keeps it there.
            "schedule": {
                "type": "gradient_noise",
                "start": 8,
                **({} if geometry == "auto" else {"geometry": geometry}),
                "warmup_steps": 1000,
                "ema_beta": 0.5,
                "ema_reference_batch": 8,
            },
            "max_micro_batch_per_gpu": 2,
            "data": {"shuffle": True, "seed": 3},
        },
    }


class _Dataset(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x, self.y = _data()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def _loss(engine, batch):
    x, y = batch
    return ((engine(x) - y) ** 2).mean()


def _owners(engine, stage: int) -> list[list[int]]:
    """For each model parameter, the rank whose share holds each of its elements, read from
    DeepSpeed's own layout (ZeRO 1-2: the flat group cut into partition_size pieces; ZeRO 3: each
    parameter cut into partition_numel pieces; ZeRO 0: the parameters end to end, cut into equal
    consecutive pieces, the probe's rule for unpartitioned state)."""
    world = torch.distributed.get_world_size()
    params = list(engine.module.parameters())
    sizes = [int(getattr(p, "ds_numel", p.numel())) for p in params]
    if stage == 3:
        return [[e // p.partition_numel() for e in range(n)] for p, n in zip(params, sizes)]
    if stage == 0:
        order, width = params, -(-sum(sizes) // world)
    else:
        opt = engine.optimizer
        order, width = opt.bit16_groups[0], int(opt.partition_size[0])
    offset, start = 0, {}
    for p in order:  # laid back to back in this order
        start[id(p)] = offset
        offset += p.numel()
    return [[(start[id(p)] + e) // width for e in range(n)] for p, n in zip(params, sizes)]


def _run_engine(
    stage: int, geometry: str, torch_adam: bool = True
) -> tuple[dict, list[list[list[list[int]]]], list]:
    """Train STEPS steps; the estimates after each, the final parameters, each rank's micro-batches per
    step and the owner of every element."""
    from deepspeed.utils import safe_get_full_fp32_param

    import ds_adabatch

    config = _ds_config(stage, geometry, torch_adam)
    engine, *_ = ds_adabatch.initialize(_model(), config, _Dataset(), loss_fn=_loss)
    estimates, steps = [], []
    for _ in range(STEPS):
        engine.train_batch()
        engine.resolve_losses()
        mine = [list(m.indices) for m in engine.last_step_batch.micro_batches]
        everyone: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
        steps.append(everyone)
        if engine.noise.count:
            estimates.append([engine.noise.last_grad_sq_norm, engine.noise.last_trace_sigma])
    params = []
    for p in engine.module.parameters():
        full = safe_get_full_fp32_param(p) if stage > 0 else p.detach()
        params += full.float().flatten().tolist()
    noise = engine.noise
    out = {"estimates": estimates, "count": noise.count, "params": params}
    out.update(grad_sq_norm=noise.grad_sq_norm, trace_sigma=noise.trace_sigma)
    owners = _owners(engine, stage)
    engine.close()
    return out, steps, owners


def _reference(steps: list[list[list[list[int]]]], owners: list[list[int]] | None) -> dict:
    """Plain PyTorch in one process: the same micro-batches, norms and AdamW steps written out.

    ``owners``: the rank whose micro-batches measure each element's small-batch norm (a mean over
    that rank's micro-batches, summed over elements); None: every element with every micro-batch."""
    model = _model()
    x, y = _data()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.0)
    est = GradientNoiseEstimator(ema_beta=0.5, reference_batch=8)
    estimates = []
    for number, per_rank in enumerate(steps, 1):
        micro = [idx for rank in per_rank for idx in rank]
        rank_of = [r for r, rank in enumerate(per_rank) for _ in rank]
        total = sum(len(idx) for idx in micro)
        grads = [_grads(model, x[idx], y[idx]) for idx in micro]
        big = [sum(g[k] * len(idx) / total for g, idx in zip(grads, micro)) for k in range(len(grads[0]))]
        for p, g in zip(model.parameters(), big):
            p.grad = g.clone()
        # DeepSpeed 0.19.8's clip: scale by clip / (norm + 1e-6) when that is below 1.
        norm = math.sqrt(sum(float((g**2).sum()) for g in big))
        coef = CLIP / (norm + 1e-6)
        if coef < 1:
            for p in model.parameters():
                p.grad.mul_(coef)
        opt.step()
        inv = _inverse_roots(opt)  # the denominator of the step just taken
        if owners is None:
            small = sum(sum(float(((gk * w) ** 2).sum()) for gk, w in zip(g, inv)) for g in grads) / len(
                grads
            )
        else:
            small = 0.0
            for r in range(len(per_rank)):
                mine = [g for g, rr in zip(grads, rank_of) if rr == r]
                for k, w in enumerate(inv):
                    held = torch.tensor(owners[k]).view(w.shape) == r
                    small += sum(float(((g[k] * w) ** 2)[held].sum()) for g in mine) / len(mine)
        big_sq = sum(float(((gk * w) ** 2).sum()) for gk, w in zip(big, inv))
        b_small = len(micro) / sum(1 / len(idx) for idx in micro)
        if number < SETTLED_STEPS:
            continue  # the first steps' second moments are too young to weigh by
        est.update(b_small, small, total, big_sq)
        estimates.append([est.last_grad_sq_norm, est.last_trace_sigma])
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    return {
        "estimates": estimates,
        "grad_sq_norm": est.grad_sq_norm,
        "trace_sigma": est.trace_sigma,
        "params": params,
    }


def _with_sgd(geometry: str) -> dict:
    """Plain SGD under ``geometry``: the error ``initialize`` raises, or the geometry and scale it set."""
    import ds_adabatch

    cfg = _ds_config(1, geometry)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.01}}
    cfg["zero_allow_untested_optimizer"] = True
    try:
        engine, *_ = ds_adabatch.initialize(_model(), cfg, _Dataset(), loss_fn=_loss)
    except ConfigError as err:
        return {"error": str(err)}
    out = {"geometry": engine._noise_geometry, "scale": engine.controller.schedule.scale}
    engine.close()
    return out


def _worker(out_dir: str) -> None:
    torch.set_num_threads(1)
    doc: dict = {}
    runs = {}
    for stage in STAGES:
        # ZeRO 3 leaves the geometry at its default, "auto": with AdamW it must measure as "adam".
        doc[f"zero{stage}"], *runs[stage] = _run_engine(stage, "auto" if stage == 3 else "adam")
    doc["zero2_sgd"], *_ = _run_engine(2, "sgd")
    # DeepSpeed's FusedAdam under ZeRO 0: it counts its steps in the last parameter's state only.
    doc["zero0_fused"], *runs["fused"] = _run_engine(0, "adam", torch_adam=False)
    doc["sgd_optimizer"] = {geometry: _with_sgd(geometry) for geometry in ("adam", "auto")}
    if torch.distributed.get_rank() == 0:
        for stage, (steps, owners) in runs.items():
            doc[f"reference{stage}"] = _reference(steps, owners)
        doc["pooled"] = _reference(runs[2][0], None)
        (Path(out_dir) / "adam_geometry.json").write_text(json.dumps(doc))
    import ds_adabatch

    ds_adabatch.finish()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, str(ROOT))
    _worker(sys.argv[1])
