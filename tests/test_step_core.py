"""The step core (``runtime/core/step_core.py``): one decision cycle, held by every entry point.

One process (no process group: a ``StepSync`` all-reduce sums the values themselves, and counts its
collectives); the same decisions over two gloo ranks are checked through the engines in
``test_step_collectives.py`` and ``test_hf_step_collectives.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_adabatch.config import AdaBatchConfig
from ds_adabatch.data import ElasticDataLoader, ElasticSampler
from ds_adabatch.plan import plan_batch
from ds_adabatch.runtime.core.step_core import Progress, StepAttachments, StepCore, plan_change
from ds_adabatch.runtime.core.sync import StepSync
from ds_adabatch.runtime.memory.predictor import _allocator_counters, _CudaCounters, _peak_and_resident
from ds_adabatch.runtime.memory.recovery import memory_for
from ds_adabatch.schedules import BatchSizeController

ROOT = Path(__file__).resolve().parent.parent / "ds_adabatch"

CALLS: list[int] = []


def grow_by_four(step: int, batch_size: int) -> int:
    """A user schedule: +4 samples at every evaluation (it remembers its answer: agreed state)."""
    CALLS.append(step)
    return batch_size + 4


def core_for(schedule: dict, world: int = 2, rank: int = 0, **fields) -> tuple[StepCore, dict]:
    cfg = AdaBatchConfig.model_validate({"schedule": schedule, "max_micro_batch_per_gpu": 4, **fields})
    controller = BatchSizeController(cfg, world)
    progress = {"samples": 0, "lr": None}
    core = StepCore(
        controller,
        sync=StepSync("cpu"),
        attach=StepAttachments(memory=memory_for(cfg)),
        progress=lambda: Progress(samples=progress["samples"], tokens=None, epoch=0.0, lr=progress["lr"]),
        rank=rank,
        world_size=world,
        allow_uneven=cfg.allow_uneven,
        scheduled_batch=controller.initial_global_batch(),
    )
    return core, progress


def test_a_ramp_is_decided_planned_and_the_steady_plan_is_not_solved_again():
    core, progress = core_for({"type": "step", "start": 8, "end": 16, "increment": 8, "ramp_samples": 16})
    first = core.decide(0)
    assert (first.batch, first.previous) == (8, 8)
    assert first.plan == plan_batch(8, 2, 4)
    progress["samples"] = 8
    held = core.decide(1)
    assert held.batch == 8 and held.plan is first.plan, "a steady step must reuse the solved plan"
    progress["samples"] = 16
    grown = core.decide(2)
    assert (grown.batch, grown.previous, core.scheduled_batch) == (16, 8, 16)
    assert grown.plan == plan_batch(16, 2, 4) and grown.plan.gradient_accumulation_steps == 2
    assert core.sync.collectives == 0, "a schedule fed global values needs no collective"


def test_a_lower_limit_replans_the_same_batch():
    core, _ = core_for({"type": "constant", "value": 16})
    assert core.decide(0).plan.micro_batch_per_gpu == 4
    core.attach.memory.on_oom(4)  # the learned limit drops: the cached plan no longer applies
    lowered = core.decide(1).plan
    assert lowered.global_batch_size == 16 and lowered.micro_batch_per_gpu < 4


def test_a_loss_schedule_resolves_pending_losses_before_it_decides():
    core, _ = core_for({"type": "loss_plateau", "start": 8})
    seen: list[float | None] = []
    read = core._progress
    core._progress = lambda: (seen.append(core.last_loss), read())[1]  # the context is being built
    core.decide(0)
    core.sync.defer([torch.tensor(2.5)], lambda sums: core.signals_resolved(float(sums[0]), None))
    core.decide(1)
    assert core.sync.collectives == 1 and not core.sync.pending, "the pending loss must be summed"
    assert seen[-1] == 2.5, "the loss must be resolved before the schedule's context is built"
    assert core.context(2).loss == 2.5 and core.loss_ema.value is not None


def test_an_override_is_agreed_once_and_a_user_function_at_every_evaluation():
    core, _ = core_for({"type": "constant", "value": 8})
    core.decide(0)
    core.set_override(24, "manual")
    assert core.decide(1).batch == 24 and core.decide(2).batch == 24
    assert core.sync.collectives == 1, "an override is agreed in one collective, once"
    core.set_override(None)
    assert core.decide(3).batch == 8

    CALLS.clear()
    user, _ = core_for({"type": "callable", "function": f"{__name__}:grow_by_four", "start": 8})
    for step in range(4):
        decision = user.decide(step)
    assert CALLS == [1, 2, 3] and decision.batch == 20
    assert user.sync.collectives == 3, "a user function's answer is agreed at each evaluation"


def loaders(n: int, world: int) -> list[ElasticDataLoader]:
    """Every rank's loader over ``dataset[i] == i`` (in order), in one process."""
    return [
        ElasticDataLoader(list(range(n)), ElasticSampler(n, shuffle=False), rank=r, world_size=world)
        for r in range(world)
    ]


def served(step) -> list[int]:
    """The samples a rank's step holds, pass by pass (pads left out)."""
    return [i for m in step.micro_batches for i in m.indices]


def test_the_core_draws_each_step_and_replans_the_epoch_tail():
    cores = [core_for({"type": "constant", "value": 8}, rank=r)[0] for r in range(2)]
    ranks = loaders(10, 2)
    plan = cores[0].decide(0).plan
    first = [core.draw(loader, plan) for core, loader in zip(cores, ranks)]
    assert all(d.tail is None and d.split is None and d.plan == plan for d in first)
    assert all(core.last_step is d.step for core, d in zip(cores, first)), "the core holds the step it drew"
    tail = [core.draw(loader, plan) for core, loader in zip(cores, ranks)]
    assert tail[0].tail == plan_batch(2, 2, 4) and tail[0].plan == tail[0].tail, (
        "the epoch's last 2 samples must come re-planned, for the holder to apply with a record"
    )
    assert sorted(i for d in first + tail for i in served(d.step)) == list(range(10))
    # The next step goes back to the scheduled batch, and says so (not the schedule's "hold").
    back = cores[0].decide(2)
    assert back.plan == plan and back.reason == "the scheduled batch again after the epoch's last batch"
    assert cores[0].decide(3).reason != back.reason, "said only at the return"


def test_a_noise_measured_single_pass_is_drawn_as_two_half_passes():
    core, _ = core_for({"type": "constant", "value": 6}, world=1, max_micro_batch_per_gpu=8)
    plan = core.decide(0).plan
    assert plan.gradient_accumulation_steps == 1
    (loader,) = loaders(10, 1)
    drawn = core.draw(loader, plan, split=True)
    assert drawn.split == plan_batch(6, 1, 3, allow_uneven=True) and drawn.restore == plan
    assert drawn.plan == drawn.split and [len(m.indices) for m in drawn.step.micro_batches] == [3, 3]
    assert served(drawn.step) == list(range(6)) and core.last_step is drawn.step
    # The epoch's tail of 4 samples, split too: back to the tail's plan after the step.
    tail = core.draw(loader, plan, split=True)
    assert tail.tail == plan_batch(4, 1, 8) and tail.restore == tail.tail
    assert tail.split == plan_batch(4, 1, 2) and served(tail.step) == [6, 7, 8, 9]


@pytest.mark.parametrize(
    ("world", "batch", "max_micro", "n"),
    [(2, 8, 4, 16), (1, 8, 4, 16), (1, 1, 4, 4)],
    ids=["two ranks", "two accumulation steps", "one sample"],
)
def test_a_step_of_more_than_one_pass_or_one_sample_is_not_split(world, batch, max_micro, n):
    core, _ = core_for({"type": "constant", "value": batch}, world=world, max_micro_batch_per_gpu=max_micro)
    plan = core.decide(0).plan
    drawn = core.draw(loaders(n, world)[0], plan, split=True)
    assert (drawn.split, drawn.restore, drawn.tail) == (None, None, None) and drawn.plan == plan


def test_a_recut_runs_the_same_samples_at_another_plan_and_consumes_nothing():
    core, _ = core_for({"type": "constant", "value": 8}, world=1, max_micro_batch_per_gpu=8)
    (loader,) = loaders(16, 1)
    drawn = core.draw(loader, core.decide(0).plan)
    smaller = plan_batch(8, 1, 2)
    again = core.recut(loader, drawn.step, smaller)
    assert again.plan == smaller and len(again.micro_batches) == 4 and served(again) == served(drawn.step)
    assert core.last_step is again, "the core holds the step as cut for its latest attempt"
    assert served(core.draw(loader, core.decide(1).plan).step) == list(range(8, 16)), (
        "a recut consumed samples"
    )


def test_a_stage_that_feeds_nothing_draws_without_loading():
    core, _ = core_for({"type": "constant", "value": 4}, world=1)
    (loader,) = loaders(8, 1)
    drawn = core.draw(loader, core.decide(0).plan, load=False)
    assert [m.batch for m in drawn.step.micro_batches] == [None] and served(drawn.step) == [0, 1, 2, 3]


def test_every_entry_point_draws_through_the_core():
    """The loader's step is drawn and re-cut in the core only (train_batch, the loop, the pipeline, the
    Trainer)."""
    for name in (".next_step(", ".reload("):
        users = sorted(
            p.relative_to(ROOT).as_posix()
            for folder in ("runtime", "integrations")
            for p in (ROOT / folder).rglob("*.py")
            if name in p.read_text(encoding="utf-8")
        )
        assert set(users) <= {"runtime/core/draw.py", "runtime/core/step_core.py"}, (
            f"{name} is called outside the step core: {users}"
        )


def test_plan_changes_are_built_in_one_place():
    old, new = plan_batch(8, 2, 4), plan_batch(24, 2, 4)
    event = plan_change(old, new, step=5, samples=40, lr_multiplier=3.0, reason="manual")
    assert (event.old_global_batch, event.new_global_batch) == (8, 24)
    assert (event.old_micro_batch_per_gpu, event.new_micro_batch_per_gpu) == (4, 4)
    assert (event.old_gradient_accumulation_steps, event.new_gradient_accumulation_steps) == (1, 3)
    assert (event.step, event.samples, event.world_size, event.reason) == (5, 40, 2, "manual")
    built = [
        path.relative_to(ROOT).as_posix()
        for path in ROOT.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "PlanChange"
        and any(k.arg for k in node.keywords)
    ]
    assert built == ["runtime/core/step_core.py"], f"PlanChange is built field by field in {built}"


def test_every_entry_point_decides_through_the_core():
    """The schedule's decision (evaluates_at, the agreement, the context) is written in the core only."""
    for name in ("evaluates_at(", "needs_agreement", "ScheduleContext(", "load_shared_state("):
        users = sorted(
            p.relative_to(ROOT).as_posix()
            for p in (ROOT / "runtime").rglob("*.py")
            if name in p.read_text(encoding="utf-8")
        ) + sorted(
            p.relative_to(ROOT).as_posix()
            for p in (ROOT / "integrations").rglob("*.py")
            if name in p.read_text(encoding="utf-8") and p.name in ("state.py", "step.py")
        )
        assert users == ["runtime/core/step_core.py"], f"{name} is used outside the step core: {users}"


def test_the_core_state_continues_in_a_fresh_core():
    """What the next decisions read (override, signals, schedule state, learned limit) round-trips."""
    section = {"type": "loss_plateau", "start": 8}
    core, _ = core_for(section)
    core.set_override(24, "manual")
    core.decide(0)  # agrees the override
    core.signals_resolved(2.5, 1.25)
    core.signals_resolved(2.0, None)
    core.attach.memory.on_oom(4)
    state = core.state_dict()
    fresh, _ = core_for(section)
    fresh.load_state_dict(state)
    assert fresh.override == (24, "manual") and fresh.state_dict() == {**state, "scheduled_batch": 8}, (
        "a fresh core loaded from state_dict() must hold the same state (the holder re-plans the batch)"
    )
    assert (fresh.last_loss, fresh.last_grad_norm, fresh.loss_ema.value) == (2.0, None, core.loss_ema.value)
    assert fresh.attach.memory.limit == core.attach.memory.limit < 4, "the learned limit was not restored"


def test_the_engines_hold_their_parts_instead_of_mixing_them_in():
    from ds_adabatch.runtime.engine.base import AdaptiveEngineBase
    from ds_adabatch.runtime.engine.data_parallel import AdaptiveBatchEngine
    from ds_adabatch.runtime.pipeline.engine import AdaptivePipelineEngine

    for engine in (AdaptiveBatchEngine, AdaptivePipelineEngine):
        bases = [c.__name__ for c in engine.__mro__[1:-1]]
        assert bases == [AdaptiveEngineBase.__name__], f"{engine.__name__} mixes in {bases}"


def test_the_allocator_counters_read_off_an_accelerator_are_the_stand_ins():
    class Counters:
        def max_memory_allocated(self) -> int:
            return 7

        def memory_allocated(self) -> int:
            return 3

    assert _peak_and_resident(Counters()) == (7, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_counters_read_what_torch_reads_in_one_call():
    counters = _allocator_counters()
    assert isinstance(counters, _CudaCounters)
    keep = torch.empty(1 << 20, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    torch.empty(1 << 22, device="cuda")
    assert counters.peak_and_resident() == (torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated())
    del keep


def test_the_noise_split_cadence_is_in_the_state_and_an_older_state_loads():
    """Which step was last split to measure the noise (one rank, GAS 1) is the step core's state: a
    resumed run splits the steps the uninterrupted one would. A state written before it was kept loads."""
    from ds_adabatch.runtime.noise.probe import NoiseCadence

    schedule = {"type": "gradient_noise", "start": 8}

    def with_cadence() -> StepCore:
        core, _ = core_for(schedule, world=1)
        core.attach.noise_cadence = NoiseCadence(core.controller.schedule_config)
        return core

    saved = with_cadence()
    assert saved.attach.noise_cadence.due(4, 1, 1, can_split=True)  # split: the cadence remembers 4
    state = saved.state_dict()
    assert state["noise_cadence"] == {"last_split": 4}
    resumed = with_cadence()
    resumed.load_state_dict(state)
    assert resumed.attach.noise_cadence.last_split == 4
    assert not resumed.attach.noise_cadence.due(5, 1, 1, can_split=True)  # as the saved run would
    older = with_cadence()
    older.load_state_dict({k: v for k, v in state.items() if k != "noise_cadence"})
    assert older.attach.noise_cadence.last_split is None


def test_an_even_split_of_many_more_passes_than_needed_is_said_once(caplog):
    """A ramp through 29 samples on one rank with micro-batches of at most 4 splits evenly only as
    micro 1 x GAS 29 (8 passes would hold it): said once, with what to set; an uneven section is quiet."""
    core, _ = core_for({"type": "constant", "value": 8}, world=1)
    with caplog.at_level("WARNING", logger="ds_adabatch"):
        assert core.plan_for(12).gradient_accumulation_steps == 3  # the fewest: quiet
        assert core.plan_for(29).gradient_accumulation_steps == 29
        assert core.plan_for(31).gradient_accumulation_steps == 31
    said = [r.getMessage() for r in caplog.records if "splits evenly only" in r.getMessage()]
    assert len(said) == 1 and "micro 1 x gas 29" in said[0] and '"allow_uneven": true' in said[0], said
    uneven, _ = core_for({"type": "constant", "value": 8}, world=1, allow_uneven=True)
    caplog.clear()
    with caplog.at_level("WARNING", logger="ds_adabatch"):
        assert uneven.plan_for(29).gradient_accumulation_steps == 8
        # 9 on 2 ranks under 4: 5 samples on a rank need 2 passes (not 1), and the split is uneven already.
        assert core_for({"type": "constant", "value": 8}, world=2, allow_uneven=True)[0].plan_for(9)
    assert not caplog.records


def test_a_limit_the_prediction_lowers_is_the_reason_of_the_plan_change_it_causes():
    """The agreed predicted bound lowers the limit from 4 to 3: said once, as the reason the next plan
    change gives (not the schedule's own "hold"); a bound that moves nothing says nothing."""
    core, _ = core_for({"type": "constant", "value": 8})
    memory = core.attach.memory
    memory.set_cap(3)
    core.clean_step(4)
    assert core.take_memory_reason() == "micro-batch limit 4 -> 3 (the predicted peak memory)"
    memory.set_cap(3)  # the same verdict again: the limit stays
    core.clean_step(3)
    assert core.take_memory_reason() is None
    assert core.decide(1).plan == plan_batch(8, 2, 3)


def test_a_loss_is_read_from_a_tuple_and_only_a_token_count_is_checked():
    from ds_adabatch.runtime.core.weights import loss_of

    loss = torch.tensor(1.5)
    assert loss_of(loss, 3, "loss_fn") is loss
    assert loss_of((loss, torch.randn(4, 5), None), 3, "loss_fn") is loss  # (loss, logits, ...)
    assert loss_of((loss, torch.randn(4, 5)), 3, "loss_fn") is loss  # logits are not a count
    assert loss_of((loss, 3), 3, "loss_fn") is loss and loss_of((loss, torch.tensor(3)), 3, "loss_fn") is loss
    assert loss_of((loss, 4), None, "loss_fn") is loss  # sample normalisation: nothing to check
    with pytest.raises(ValueError, match="num_tokens=4 .* counted as 3 .*token_count_fn"):
        loss_of((loss, 4), 3, "loss_fn")
    for count in (5.0, np.int64(5), torch.tensor(5.0)):  # whole numbers of any type are counts
        with pytest.raises(ValueError, match="num_tokens=5"):
            loss_of((loss, count), 3, "loss_fn")
    assert loss_of((loss, torch.tensor(0.01)), 3, "loss_fn") is loss  # an auxiliary loss is no count
