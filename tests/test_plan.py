"""The batch planner: invariants (hypothesis), documented literal plans, rounding, elastic sizes."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from ds_adabatch.plan import (
    BatchPlan,
    PlanError,
    batch_multiple,
    compatible_batch_sizes,
    feasible_range,
    nearest_plannable,
    plan_batch,
    round_global_batch,
)

WORLD = st.integers(1, 512)
GLOBAL = st.integers(1, 10**6)
MICRO = st.integers(1, 4096)
# Enumerating every slot of a plan costs world x steps; beyond this the examples get slow and add
# nothing the smaller ones do not already cover.
MAX_SLOTS = 200_000


def _all_sizes(plan: BatchPlan) -> list[tuple[int, ...]]:
    return [plan.micro_batch_sizes(rank) for rank in range(plan.world_size)]


def _even_steps_feasible(per_rank: int, steps: int, max_micro: int) -> bool:
    return per_rank % steps == 0 and per_rank // steps <= max_micro


def _check_common_invariants(plan: BatchPlan, b: int, w: int, m: int) -> list[tuple[int, ...]]:
    assert (plan.global_batch_size, plan.world_size) == (b, w), f"plan describes another request: {plan}"
    sizes = _all_sizes(plan)
    steps = plan.gradient_accumulation_steps
    assert all(len(s) == steps for s in sizes), f"ranks disagree on accumulation steps: {plan}"
    flat = [x for s in sizes for x in s]
    assert max(flat) <= m, f"a micro-batch of {max(flat)} exceeds max micro {m}: {plan}"
    assert max(flat) == plan.micro_batch_per_gpu, f"micro_batch_per_gpu is not the largest size: {plan}"
    assert sum(flat) == b, f"sizes sum to {sum(flat)}, not the global batch {b}: {plan}"
    assert min(flat) >= 0
    assert sum(plan.rank_batch_size(r) for r in range(w)) == b
    keys = plan.deepspeed_batch_keys()
    assert (
        keys["train_batch_size"]
        == keys["train_micro_batch_size_per_gpu"] * keys["gradient_accumulation_steps"] * w
    )
    assert keys["train_batch_size"] >= b
    return sizes


@st.composite
def divisible(draw: st.DrawFn) -> tuple[int, int]:
    """A world size and a global batch (<= 10**6) that it divides."""
    w = draw(WORLD)
    return draw(st.integers(1, 10**6 // w)) * w, w


@st.composite
def indivisible(draw: st.DrawFn) -> tuple[int, int]:
    """A world size >= 2 and a global batch (<= 10**6) that it does not divide."""
    w = draw(st.integers(2, 512))
    b = draw(st.integers(0, 10**6 // w - 1)) * w + draw(st.integers(1, w - 1))
    return b, w


@given(bw=divisible(), m=MICRO)
def test_even_plan_invariants(bw: tuple[int, int], m: int) -> None:
    b, w = bw
    plan = plan_batch(b, w, m)
    assume(plan.world_size * plan.gradient_accumulation_steps <= MAX_SLOTS)
    sizes = _check_common_invariants(plan, b, w, m)
    assert len({x for s in sizes for x in s}) == 1, f"an even plan has unequal sizes: {plan}"
    assert plan.is_even and not plan.has_padding
    per_rank, steps = b // w, plan.gradient_accumulation_steps
    fewer = [g for g in range(1, steps) if _even_steps_feasible(per_rank, g, m)]
    assert not fewer, f"{fewer[0]} steps would also split {b} over {w} ranks evenly, plan used {steps}"


@given(b=GLOBAL, w=WORLD, m=MICRO)
def test_uneven_plan_invariants(b: int, w: int, m: int) -> None:
    plan = plan_batch(b, w, m, allow_uneven=True)
    steps = plan.gradient_accumulation_steps
    assume(w * steps <= MAX_SLOTS)
    sizes = _check_common_invariants(plan, b, w, m)
    flat = [x for s in sizes for x in s]
    assert max(flat) - min(flat) <= 1, f"uneven sizes differ by more than one: {plan}"
    # Minimality, directly: steps - 1 accumulation steps cannot hold b samples at m per slot.
    assert steps == 1 or w * (steps - 1) * m < b, f"{steps - 1} steps would fit {b} samples: {plan}"
    if 0 in flat:
        assert b < w * steps, f"an empty slot although every slot could get a sample: {plan}"
        assert plan.has_padding
    if b >= w * steps:
        assert 0 not in flat


@given(b=GLOBAL, w=WORLD, m=MICRO)
def test_uneven_is_even_when_an_even_plan_is_as_short(b: int, w: int, m: int) -> None:
    uneven = plan_batch(b, w, m, allow_uneven=True)
    if b % w:
        assert not uneven.is_even or b % (w * uneven.gradient_accumulation_steps) == 0
        return
    even = plan_batch(b, w, m)
    assert uneven.gradient_accumulation_steps <= even.gradient_accumulation_steps
    if uneven.gradient_accumulation_steps == even.gradient_accumulation_steps:
        assert uneven.is_even, f"an even plan with the same steps exists ({even}), got {uneven}"
        assert uneven == even


@pytest.mark.parametrize(
    ("b", "w", "m", "uneven", "expected"),
    [
        (14, 1, 4, True, [(4, 4, 3, 3)]),
        (14, 1, 4, False, [(2,) * 7]),
        (16, 2, 4, False, [(4, 4), (4, 4)]),
        (17, 2, 4, True, [(3, 3, 3), (3, 3, 2)]),
        (3, 4, 8, True, [(1,), (1,), (1,), (0,)]),
        (7, 1, 7, False, [(7,)]),
        (7, 1, 6, False, [(1,) * 7]),
        (64, 8, 8, False, [(8,)] * 8),
        (10, 4, 2, True, [(2, 1), (2, 1), (1, 1), (1, 1)]),
    ],
)
def test_documented_plans(b: int, w: int, m: int, uneven: bool, expected: list[tuple[int, ...]]) -> None:
    plan = plan_batch(b, w, m, allow_uneven=uneven)
    assert _all_sizes(plan) == expected


def test_documented_plan_details() -> None:
    plan = plan_batch(14, 1, 4, allow_uneven=True)
    assert (plan.micro_batch_per_gpu, plan.gradient_accumulation_steps) == (4, 4)
    assert plan.deepspeed_batch_keys() == {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 4,
    }
    assert plan.describe() == "global 14 = micro 4 x gas 4 on 1 rank (uneven)"
    even = plan_batch(14, 1, 4)
    assert (even.micro_batch_per_gpu, even.gradient_accumulation_steps) == (2, 7)
    assert even.describe() == "global 14 = micro 2 x gas 7 on 1 rank"
    padded = plan_batch(3, 4, 8, allow_uneven=True)
    assert padded.has_padding and padded.describe().endswith("(uneven, padded)")
    assert padded.slot_offsets() == [[(0, 1), (1, 2), (2, 3), (3, 3)]]


def test_plan_is_immutable() -> None:
    plan = plan_batch(16, 2, 4)
    with pytest.raises(AttributeError):
        plan.global_batch_size = 32  # type: ignore[misc]


@given(bw=indivisible(), m=MICRO)
def test_plan_error_names_nearest_feasible_batches(bw: tuple[int, int], m: int) -> None:
    b, w = bw
    with pytest.raises(PlanError) as info:
        plan_batch(b, w, m)
    named = {int(n) for n in re.findall(r"\d+", str(info.value).split("batches are", 1)[1].split("(", 1)[0])}
    above = (b // w + 1) * w
    below = (b // w) * w
    assert above in named, f"the next feasible batch {above} is not named: {info.value}"
    assert below in named or below == 0, f"the previous feasible batch {below} is not named: {info.value}"
    for n in named:
        plan_batch(n, w, m)  # every named batch is feasible
    assert "allow_uneven" in str(info.value)


@pytest.mark.parametrize(
    "args",
    [(0, 1, 1), (1, 0, 1), (1, 1, 0), (True, 1, 1), (1.5, 1, 1), ("8", 2, 4), (-4, 2, 2)],
)
def test_plan_rejects_bad_arguments(args: tuple) -> None:
    with pytest.raises(PlanError, match="must be an integer >= 1"):
        plan_batch(*args)


def test_micro_batch_sizes_rejects_bad_rank() -> None:
    with pytest.raises(ValueError, match="outside"):
        plan_batch(16, 2, 4).micro_batch_sizes(2)


@pytest.mark.parametrize(
    ("desired", "world", "kwargs", "expected"),
    [
        (17, 2, {}, 18),  # ties round up
        (17, 2, {"allow_uneven": True}, 17),
        (20, 2, {"granularity": 8}, 24),  # lcm(8, 2) = 8; 2.5 rounds up
        (19.9, 2, {"granularity": 8}, 16),
        (0, 4, {}, 4),  # never below the smallest plannable batch
        (-5.0, 3, {"allow_uneven": True}, 1),
        (100, 4, {"max_global_batch": 30}, 28),
        (1, 4, {"min_global_batch": 10}, 12),
        (1000, 3, {"granularity": 4, "max_global_batch": 500}, 492),
        (33, 6, {"granularity": 4}, 36),  # lcm(4, 6) = 12
    ],
)
def test_round_global_batch(desired: float, world: int, kwargs: dict, expected: int) -> None:
    assert round_global_batch(desired, world, **kwargs) == expected


@given(
    desired=st.floats(-1e3, 1e6, allow_nan=False),
    world=st.integers(1, 64),
    granularity=st.integers(1, 64),
    uneven=st.booleans(),
    lo=st.none() | st.integers(1, 5000),
    span=st.none() | st.integers(0, 5000),
)
def test_round_global_batch_properties(desired, world, granularity, uneven, lo, span) -> None:
    hi = None if span is None else (lo or 1) + span
    step = batch_multiple(world, granularity, uneven)
    try:
        low, high = feasible_range(
            world, granularity=granularity, min_global_batch=lo, max_global_batch=hi, allow_uneven=uneven
        )
    except PlanError:
        assert hi is not None and (hi // step) * step < math.ceil((lo or 1) / step) * step
        return
    got = round_global_batch(
        desired, world, granularity=granularity, min_global_batch=lo, max_global_batch=hi, allow_uneven=uneven
    )
    assert got % step == 0 and got % granularity == 0
    assert uneven or got % world == 0
    assert got >= (lo or 1) and (hi is None or got <= hi)
    plan_batch(got, world, 1, allow_uneven=uneven)  # plannable
    # Nearest: no plannable value inside the bounds is strictly closer.
    for other in (got - step, got + step):
        if other >= low and (high is None or other <= high):
            assert abs(other - desired) >= abs(got - desired)


def test_round_global_batch_rejects_nonfinite_and_empty_bounds() -> None:
    with pytest.raises(PlanError, match="finite"):
        round_global_batch(float("inf"), 2)
    with pytest.raises(PlanError, match="no global batch between"):
        round_global_batch(6, 4, min_global_batch=5, max_global_batch=7)
    assert feasible_range(4, min_global_batch=5, max_global_batch=7, allow_uneven=True) == (5, 7)


@given(
    value=st.integers(1, 10**5),
    world=st.integers(1, 64),
    granularity=st.integers(1, 64),
    lo=st.none() | st.integers(1, 5000),
    span=st.none() | st.integers(0, 5000),
)
def test_nearest_plannable_neighbours(value, world, granularity, lo, span) -> None:
    hi = None if span is None else (lo or 1) + span
    try:
        low, high = feasible_range(world, granularity=granularity, min_global_batch=lo, max_global_batch=hi)
    except PlanError:
        with pytest.raises(PlanError):
            nearest_plannable(value, world, granularity=granularity, min_global_batch=lo, max_global_batch=hi)
        return
    near = nearest_plannable(value, world, granularity=granularity, min_global_batch=lo, max_global_batch=hi)
    assert 1 <= len(near) <= 2 and near == sorted(near)
    step = math.lcm(world, granularity)
    for v in near:
        assert v % step == 0 and low <= v and (high is None or v <= high)
        plan_batch(v, world, 1)  # plannable
    # Nothing plannable lies strictly between the suggestions and the value.
    feasible = [v for v in range(low, (high or low + 3 * step + value) + 1, step)]
    below = [v for v in feasible if v <= value]
    above = [v for v in feasible if v >= value]
    expected = {max(below) if below else min(feasible), min(above) if above else max(feasible)}
    assert set(near) == expected


def test_nearest_plannable_examples() -> None:
    assert nearest_plannable(9, 2, granularity=3) == [6, 12]
    assert nearest_plannable(9, 2, granularity=3, max_global_batch=10) == [6]
    assert nearest_plannable(17, 2) == [16, 18]
    assert nearest_plannable(18, 2) == [18]
    assert nearest_plannable(3, 4, min_global_batch=8) == [8]


def _brute_force_compatible(max_b, worlds, m, min_b, min_micro, max_gas, g):
    out = []
    for b in range(min_b, max_b + 1):
        if b % g:
            continue
        valid = []
        for w in sorted(set(worlds)):
            if b % w:
                continue
            per_rank = b // w
            micro = max(d for d in range(1, min(m, per_rank) + 1) if per_rank % d == 0)
            gas = per_rank // micro
            if micro >= min_micro and (max_gas is None or gas <= max_gas):
                valid.append(w)
        if valid:
            out.append((b, tuple(valid)))
    return sorted(out, key=lambda c: (-len(c[1]), -c[0]))


@given(
    max_b=st.integers(1, 300),
    worlds=st.lists(st.integers(1, 16), min_size=1, max_size=6),
    m=st.integers(1, 16),
    min_b=st.integers(1, 50),
    min_micro=st.integers(1, 4),
    max_gas=st.none() | st.integers(1, 20),
    g=st.integers(1, 8),
)
def test_compatible_batch_sizes_matches_brute_force(max_b, worlds, m, min_b, min_micro, max_gas, g) -> None:
    assume(min_micro <= m)
    got = compatible_batch_sizes(
        max_b,
        worlds,
        m,
        min_batch_size=min_b,
        min_micro_batch_per_gpu=min_micro,
        max_gradient_accumulation_steps=max_gas,
        granularity=g,
    )
    expected = _brute_force_compatible(max_b, worlds, m, min_b, min_micro, max_gas, g)
    assert [(c.global_batch_size, c.world_sizes) for c in got] == expected


def test_compatible_batch_sizes_ranking_and_errors() -> None:
    ranked = compatible_batch_sizes(64, range(1, 9), 8)
    # Most world sizes first, then the larger batch: 60 and 48 both cover six of the eight.
    assert [(c.global_batch_size, c.world_sizes) for c in ranked[:2]] == [
        (60, (1, 2, 3, 4, 5, 6)),
        (48, (1, 2, 3, 4, 6, 8)),
    ]
    assert ranked[0].coverage == max(c.coverage for c in ranked) == 6
    with pytest.raises(PlanError, match="world_sizes"):
        compatible_batch_sizes(64, [], 8)
    with pytest.raises(PlanError, match="world_sizes"):
        compatible_batch_sizes(64, [0, 2], 8)
    with pytest.raises(PlanError, match="min_micro_batch_per_gpu"):
        compatible_batch_sizes(64, [1, 2], 4, min_micro_batch_per_gpu=8)
