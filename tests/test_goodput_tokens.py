"""The goodput schedule under token budgets (``micro_batch_tokens``), in one process: the passes a batch
takes predicted from the packing of the recent steps, and the choice in a closed loop whose steps are
packed by the runtime's own packer (ds_adabatch.data.packing.pack_step) from variable lengths."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ds_adabatch.config import AdaBatchConfig
from ds_adabatch.config.errors import ConfigError
from ds_adabatch.config.loader import load_ds_config
from ds_adabatch.data.packing import count_passes, pack_step
from ds_adabatch.schedules import BatchSizeController, ScheduleContext
from ds_adabatch.schedules.goodput_tokens import PackedShape
from ds_adabatch.signals import ThroughputModel, statistical_efficiency

BUDGET = 256
LENGTHS = np.random.default_rng(0).integers(8, 64, size=100_000)  # tokens per sample


def packed_passes(start: int, batch: int, world: int, budget: int = BUDGET) -> tuple[int, int]:
    """``(passes per rank, samples)`` of the step of ``batch`` samples from position ``start``."""
    lengths = LENGTHS[start : start + batch]
    layouts = pack_step(np.arange(len(lengths)), lengths, world_size=world, budget=budget)
    return len(layouts[0].micro_batches), len(lengths)


def packer(lengths, world, budget):
    """What the runtime binds: the token sampler's count of the passes its packer cuts ``lengths`` into."""
    return count_passes(lengths, world_size=world, budget=budget)


def test_the_passes_a_batch_takes_are_predicted_from_the_recent_steps():
    model = ThroughputModel()
    assert model.passes_for(64, 2) is None, "no token-budget step seen: nothing to predict from"
    position = 0
    for _ in range(12):  # steps of 48 samples on 2 ranks
        passes, samples = packed_passes(position, 48, 2)
        model.observe(BUDGET, passes, 2, 0.1, samples=samples)
        position += samples
    for batch in (24, 48, 96, 192, 384):
        passes = [packed_passes(position + 500 * k, batch, 2)[0] for k in range(20)]
        actual, predicted = sum(passes) / len(passes), model.passes_for(batch, 2)
        assert abs(predicted - actual) <= 0.12 * actual, (batch, predicted, actual)
        # A larger batch packs a little better (more samples of similar lengths): over-estimated, so a
        # larger batch is never rated cheaper than it runs before it is measured.
        if batch > 48:
            assert predicted >= actual, (batch, predicted, actual)
    assert model.passes_for(1, 2) == 1.0, "a step takes at least one pass"
    # The model's state keeps them: a resume predicts the same.
    again = ThroughputModel()
    again.load_state_dict(model.state_dict())
    assert again.passes_for(96, 2) == model.passes_for(96, 2)
    # A state written before token budgets were modelled loads, and knows none.
    state = model.state_dict()
    del state["packed"]
    old = ThroughputModel()
    old.load_state_dict(state)
    assert old.passes_for(96, 2) is None


@pytest.mark.parametrize(("budget", "step_batch"), [(BUDGET, 48), (2048, 16)])
def test_with_the_packer_the_recent_lengths_are_packed_at_every_batch(budget, step_batch):
    # What the runtime does: the token sampler's packer bound, every step's lengths kept. Two regimes:
    # passes full (48 samples take 4-5 passes of 256 tokens), and steps of one pass never full (16
    # samples in 2048 tokens), where the samples a pass held say nothing of what it could hold.
    model, rule = ThroughputModel(), ThroughputModel()
    model.bind_packer(packer)
    position = 0
    for _ in range(40):
        passes, samples = packed_passes(position, step_batch, 2, budget)
        model.observe(budget, passes, 2, 0.1, samples=samples, lengths=LENGTHS[position : position + samples])
        rule.observe(budget, passes, 2, 0.1, samples=samples)
        position += samples
    errors, rule_errors = [], []
    for batch in (24, 48, 64, 96, 128, 384, 1000):
        passes = [packed_passes(position + 500 * k, batch, 2, budget)[0] for k in range(40)]
        actual = sum(passes) / len(passes)
        errors.append(abs(model.passes_for(batch, 2, budget) - actual) / actual)
        rule_errors.append(abs(rule.passes_for(batch, 2, budget) - actual) / actual)
    assert max(errors) <= 0.08, errors
    if budget == 2048:  # the samples-per-pass rule takes a one-pass step for a full one
        assert max(rule_errors) > 1.0 and rule.passes_for(64, 2, budget) == 2.5, rule_errors
        assert model.passes_for(64, 2, budget) == 1.0
    # The same state predicts the same: resumed, or on another rank (the values depend on it alone).
    again = ThroughputModel()
    again.load_state_dict(model.state_dict())
    again.bind_packer(packer)
    assert [again.passes_for(b, 2, budget) for b in (40, 96, 700)] == [
        model.passes_for(b, 2, budget) for b in (40, 96, 700)
    ]
    # Without the budget (or the packer) the rule is used.
    assert model.passes_for(96, 2) == rule.passes_for(96, 2)
    # With a bucket window the order is sorted within windows: packing waits for a whole one.
    bucketed = ThroughputModel()
    bucketed.load_state_dict(model.state_dict())
    seen = model.state_dict()["lengths_seen"]
    bucketed.bind_packer(packer, min_lengths=seen + 1)
    assert bucketed.passes_for(96, 2, budget) == rule.passes_for(96, 2)
    bucketed.bind_packer(packer, min_lengths=seen)
    assert bucketed.passes_for(96, 2, budget) == model.passes_for(96, 2, budget)


def _section(**over) -> AdaBatchConfig:
    schedule = {
        "type": "goodput",
        "start": 16,
        "decide_every": 5,
        "warmup_steps": 0,
        "max_relative_error": None,
    }
    schedule.update(over.pop("schedule", {}))
    section = {"schedule": schedule, "micro_batch_tokens": BUDGET, "max_global_batch": 512, **over}
    return AdaBatchConfig.model_validate(section)


def run_loop(section, curve, noise, *, steps=200, world=2, budget_at=lambda step: BUDGET):
    """A closed loop of controller, schedule and model, each step packed from LENGTHS: per step its
    batch, passes per rank and budget; the controller's reasons in ``controller.reasons``."""
    controller = BatchSizeController(section, world)
    controller.schedule.throughput.bind_packer(packer)  # as the step core binds the token sampler's
    batch, samples, position, steps_run = controller.initial_global_batch(), 0, 0, []
    controller.reasons = []
    for step in range(steps):
        budget = budget_at(step)
        ctx = ScheduleContext(
            step=step,
            samples=samples,
            global_batch=batch,
            world_size=world,
            noise_scale=noise,
            noise_scale_error=0.1,
            pass_budget=budget,
        )
        decision = controller.next_global_batch(ctx)
        batch = decision.global_batch
        controller.reasons.append(decision.reason)
        passes, taken = packed_passes(position, batch, world, budget)
        lengths = LENGTHS[position : position + taken]
        controller.schedule.throughput.observe(
            budget, passes, world, curve(budget, passes), samples=taken, lengths=lengths
        )
        steps_run.append((batch, passes, budget))
        samples += taken
        position = (position + taken) % (len(LENGTHS) - 4096)
    return steps_run, controller


def test_the_config_takes_goodput_with_token_budgets():
    cfg = load_ds_config(
        {
            "adabatch": {
                "schedule": {"type": "goodput", "start": 16},
                "micro_batch_tokens": 512,
                "max_global_batch": 256,
            }
        }
    )
    assert cfg.adabatch.token_budget and cfg.adabatch.schedule.type == "goodput"
    # Its batch counts samples: a unit in tokens is refused, saying which schedules take one.
    for kind in ("goodput", "gradient_noise"):
        section = {"schedule": {"type": kind, "start": 16, "unit": "tokens"}, "micro_batch_tokens": 512}
        with pytest.raises(
            ConfigError, match="counts its global batch in samples.*linear, step and piecewise"
        ):
            load_ds_config({"adabatch": {**section, "max_global_batch": 256}})


def test_a_flat_cost_goes_to_the_large_end():
    steps, controller = run_loop(_section(), lambda budget, passes: 0.05, 300.0, steps=80)
    batches = [b for b, _, _ in steps]
    assert batches[-1] == 512, batches
    assert batches.index(512) <= 40, batches
    moves = [r for r in controller.reasons if r and "->" in r]
    assert moves and all("passes of 256 tokens" in r for r in moves), moves


def test_a_cost_per_pass_settles_at_the_goodput_maximum():
    def curve(budget, passes):
        return 0.02 + passes * 0.01

    noise, world = 60.0, 2
    steps, controller = run_loop(_section(), curve, noise, steps=240, world=world)
    batches = [b for b, _, _ in steps]

    def goodput(batch: int) -> float:  # the packing's mean passes at that batch, from the data itself
        passes = [packed_passes(2000 + 700 * k, batch, world)[0] for k in range(30)]
        return batch / curve(BUDGET, sum(passes) / len(passes)) * statistical_efficiency(batch, noise, 16)

    best = max(range(16, 513, 16), key=goodput)
    final = batches[-1]
    assert goodput(final) >= goodput(best) / 1.08, (final, best, goodput(final), goodput(best))
    assert 16 < final < 512, f"a cost per pass and a finite noise scale settle inside the range: {batches}"
    late = sum(a != b for a, b in zip(batches[120:], batches[121:]))
    assert late <= 2, f"{late} changes in the last 120 steps: {batches[120:]}"
    rating = controller.schedule.last_rating
    assert rating["efficiency"] == pytest.approx(statistical_efficiency(final, noise, 16))


def test_a_batch_that_takes_more_passes_than_any_measured_is_a_trial_and_undone_where_it_does_not_pay():
    # Predicted flat while one pass count is known; measured, each pass costs: the trial is undone.
    def curve(budget, passes):
        return 0.01 + passes * 0.05

    steps, controller = run_loop(_section(), curve, 4.0, steps=40)
    batches = [b for b, _, _ in steps]
    assert max(batches) > 16, f"a flat prediction tries a larger batch: {batches}"
    assert batches[-1] == 16, f"measured to cost per pass at a small noise scale, it comes back: {batches}"
    said = " | ".join(r for r in controller.reasons if r and "not kept" in r)
    assert "trial of batch" in said and "back to batch 16" in said, controller.reasons
    assert controller.schedule.trial is None


def test_a_lower_budget_after_an_out_of_memory_error_is_a_new_shape():
    # From step 30 the passes are cut at half the budget: the shapes then fitted are the new budget's.
    steps, controller = run_loop(
        _section(),
        lambda budget, passes: 0.05,
        30.0,
        steps=60,
        budget_at=lambda step: BUDGET if step < 30 else BUDGET // 2,
    )
    budgets = {m for m, _, _, _ in controller.schedule.throughput.measured(2)}
    assert budgets == {BUDGET, BUDGET // 2}, budgets
    assert all(p >= 1 for _, p, _ in steps)
    # Cut at half the budget, the same batch takes about twice the passes.
    late = [(b, p) for b, p, budget in steps[40:]]
    full = [packed_passes(0, b, 2)[0] for b, _ in late]
    assert sum(p for _, p in late) > 1.5 * sum(full), (late, full)


def test_the_shape_rated_is_the_packing_not_a_planned_split():
    model = ThroughputModel()
    for k in range(6):
        passes, samples = packed_passes(100 * k, 40, 2)
        model.observe(BUDGET, passes, 2, 0.1, samples=samples)
    section = _section()
    controller = BatchSizeController(section, 2)
    schedule = controller.schedule
    schedule.throughput = model
    ctx = ScheduleContext(step=0, samples=0, global_batch=40, world_size=2, pass_budget=BUDGET)
    plan = schedule._plan(ctx, 200)
    assert isinstance(plan, PackedShape) and plan.micro_batch_per_gpu == BUDGET
    assert plan.gradient_accumulation_steps == max(1, round(plan.passes))
    assert math.isclose(plan.passes, model.passes_for(200, 2))


def test_a_trial_state_written_before_token_budgets_loads():
    controller = BatchSizeController(_section(), 2)
    schedule = controller.schedule
    state = schedule.state_dict()
    state["trial"] = [10, 8, 1, 2, 16]  # (step, micro, gas, world, batch it left), as before
    schedule.load_state_dict(state)
    assert schedule.trial == (10, 8, 1, 2, 16, 16)  # moved to its shape's batch: 8 x 1 on 2 ranks


def test_a_token_step_is_kept_whatever_its_pass_count_only_the_first_at_a_budget_is_not():
    model = ThroughputModel()
    for passes in (1, 3, 2, 5, 4):
        model.observe(BUDGET, passes, 2, 0.01 * passes, samples=10 * passes)
    kept = {g: n for m, g, _, n in model.measured(2)}
    assert kept == {3: 1, 2: 1, 5: 1, 4: 1}, "only the first step at the budget is left out"
    assert model.predict(BUDGET, 6, 2) == pytest.approx(0.06)
    model.observe(BUDGET // 2, 3, 2, 0.05, samples=20)  # a new budget: its first step is left out
    assert (BUDGET // 2, 3) not in {(m, g) for m, g, _, _ in model.measured(2)}


def test_the_default_warm_up_undoes_a_larger_batch_whose_passes_cost():
    # Each step of a larger batch takes another number of passes: measured all the same, its trial is
    # judged on its own steps and undone, as a trial of whole micro-batches is. What the warm-up may
    # still take is a batch whose steps take as many passes as start's (as the packed lengths say):
    # it costs no more a step.
    def curve(budget, passes):
        return 0.01 + passes * 0.05

    section = _section(schedule={"warmup_steps": None, "ema_beta": 0.95})
    steps, controller = run_loop(section, curve, 4.0, steps=20)
    batches = [b for b, _, _ in steps]
    tried = max(batches)
    assert tried > 16 and 16 <= batches[-1] < tried, batches
    assert any(r and "not kept" in r for r in controller.reasons), controller.reasons
    start_passes = max(p for b, p, _ in steps[:4])
    assert all(p <= start_passes for _, p, _ in steps[-8:]), steps


def test_packed_passes_depend_on_the_state_alone_within_a_refresh():
    # Past 4,096 lengths the oldest kept ones drop out with every step. A rating remembered early in a
    # refresh (512 samples) must equal the rating a resumed run computes later in it, from the state.
    model = ThroughputModel()
    model.bind_packer(packer)
    position = 0
    for _ in range(130):  # 130 x 48 = 6,240 lengths: the kept ones have wrapped
        passes, n = packed_passes(position, 48, 2)
        model.observe(BUDGET, passes, 2, 0.1, samples=n, lengths=LENGTHS[position : position + n])
        position += n
    early = {b: model.passes_for(b, 2, BUDGET) for b in (40, 96, 700, 3000)}
    for _ in range(8):  # 384 more: the same refresh (6,240 -> 6,624 stays within 6,144..6,655)
        passes, n = packed_passes(position, 48, 2)
        model.observe(BUDGET, passes, 2, 0.1, samples=n, lengths=LENGTHS[position : position + n])
        position += n
    resumed = ThroughputModel()
    resumed.load_state_dict(model.state_dict())
    resumed.bind_packer(packer)
    assert {b: resumed.passes_for(b, 2, BUDGET) for b in early} == early
    assert {b: model.passes_for(b, 2, BUDGET) for b in early} == early
