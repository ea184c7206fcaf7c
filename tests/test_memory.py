"""The learned micro-batch limit (pure policy), the ``memory`` config section and the fault injector."""

from __future__ import annotations

import pytest
import torch

from ds_adabatch.config import ConfigError, load_ds_config
from ds_adabatch.runtime.memory.limit import MicroBatchMemory
from ds_adabatch.runtime.memory.predictor import PeakMemoryModel
from ds_adabatch.runtime.memory.restart_record import new_record, read_records, remove_records, write_record
from ds_adabatch.testing import simulated_memory, simulated_memory_limit


def _run(memory: MicroBatchMemory, budget: int, steps: int, per_rank: int = 16) -> list[int]:
    """Plan ``per_rank`` samples per step with uneven splits; OOM above ``budget``; return micro per step."""
    used = []
    for _ in range(steps):
        while True:
            gas = -(-per_rank // memory.limit)
            micro = -(-per_rank // gas)
            if micro <= budget:
                break
            memory.on_oom(micro)
        used.append(micro)
        memory.on_clean_step(micro)
    return used


def test_halves_on_oom_then_converges_to_the_largest_fitting_size():
    memory = MicroBatchMemory(16, 16, grow_after_steps=2)
    used = _run(memory, budget=6, steps=12)
    assert used[0] == 4, f"16 and 8 fail, 4 fits: {used}"
    assert 6 in used[:5], f"the largest fitting micro-batch (6) must be found within a few steps: {used}"
    assert max(used) == 6, f"never runs above the budget once learned: {used}"
    assert used[-4:] == [6, 6, 6, 6], used


def test_grows_back_when_the_budget_rises_and_backs_off_on_repeated_failure():
    memory = MicroBatchMemory(16, 16, grow_after_steps=2, backoff_factor=2.0)
    _run(memory, budget=6, steps=12)
    failures_before = dict(memory._state().failures)
    assert failures_before.get(8, 0) >= 1, failures_before
    used = _run(memory, budget=16, steps=12)
    assert used[-1] == 16, f"after the budget rises the limit must grow back to the ceiling: {used}"
    assert memory.limit == 16 and not memory._state().failures


def test_backoff_waits_longer_before_retrying_a_size_that_failed_twice():
    memory = MicroBatchMemory(8, 8, grow_after_steps=1, backoff_factor=3.0)
    memory.on_oom(8)  # -> 4, then bisects 4 -> 6 -> 7 and retries 8
    assert memory.limit == 4
    waits = []
    for _ in range(3):
        steps_at_7 = 0
        while memory.limit < 8:
            steps_at_7 += memory.limit == 7
            decision = memory.on_clean_step(memory.limit)
            assert steps_at_7 < 100, "never retried"
        assert decision is not None and "retry" in decision.reason, decision
        waits.append(steps_at_7)
        memory.on_oom(8)  # fails again at 8: back to the last clean size
        assert memory.limit == 7, "after a failed retry the limit returns to the largest clean one"
    assert waits == [1, 3, 9], f"each failure at 8 multiplies the wait by backoff_factor 3: {waits}"


def test_oom_at_one_sample_is_an_error_and_keys_keep_their_own_limits():
    memory = MicroBatchMemory(4, 4, grow_after_steps=None)
    memory.on_oom(4)
    assert memory.limit == 2
    memory.set_key(2048)
    assert memory.limit == 4, "a new shape key starts at the initial limit"
    memory.on_oom(2)
    assert memory.limit == 1
    with pytest.raises(MemoryError, match="1 sample"):
        memory.on_oom(1)
    memory.set_key(None)
    assert memory.limit == 2
    assert memory.on_clean_step(2) is None, "grow_after_steps None never grows"
    state = memory.state_dict()
    restored = MicroBatchMemory(4, 4, grow_after_steps=None)
    restored.load_state_dict(state)
    assert restored.limits() == {None: 2, 2048: 1}
    restored.set_key(2048)
    assert restored.limit == 1
    with pytest.raises(ValueError, match="version"):
        restored.load_state_dict({**state, "version": 99})


def _section(**adabatch) -> dict:
    return {"adabatch": {"schedule": {"type": "constant", "value": 32}, **adabatch}}


def test_config_auto_and_memory_section():
    loaded = load_ds_config(
        _section(max_micro_batch_per_gpu="auto", memory={"micro_batch_ceiling": 8}), world_size=2
    )
    cfg = loaded.adabatch
    assert cfg.auto_micro_batch and cfg.micro_batch_limit == 8 and cfg.memory.recover_from_oom
    assert loaded.plan.micro_batch_per_gpu == 8 and loaded.plan.gradient_accumulation_steps == 2
    unbounded = load_ds_config(_section(max_micro_batch_per_gpu="auto"), world_size=2)
    assert unbounded.plan.gradient_accumulation_steps == 1, "auto without a ceiling starts at one pass"
    first = load_ds_config(
        _section(max_micro_batch_per_gpu="auto", memory={"initial_micro_batch_per_gpu": 4}), world_size=2
    )
    assert first.plan.micro_batch_per_gpu == 4
    assert load_ds_config(_section(max_micro_batch_per_gpu=4)).adabatch.memory.grow_after_steps == 100


@pytest.mark.parametrize(
    ("section", "path"),
    [
        ({"max_micro_batch_per_gpu": "big"}, "adabatch.max_micro_batch_per_gpu"),
        ({"max_micro_batch_per_gpu": 0}, "adabatch.max_micro_batch_per_gpu"),
        (
            {"max_micro_batch_per_gpu": "auto", "memory": {"recover_from_oom": False}},
            "adabatch.memory.recover_from_oom",
        ),
        (
            {"max_micro_batch_per_gpu": 4, "memory": {"micro_batch_ceiling": 8}},
            "adabatch.memory.micro_batch_ceiling",
        ),
        (
            {
                "max_micro_batch_per_gpu": "auto",
                "memory": {"initial_micro_batch_per_gpu": 16, "micro_batch_ceiling": 8},
            },
            "adabatch.memory.initial_micro_batch_per_gpu",
        ),
        ({"max_micro_batch_per_gpu": 4, "memory": {"backoff_factor": 0.5}}, "adabatch.memory.backoff_factor"),
        ({"max_micro_batch_per_gpu": 4, "memory": {"grow_after": 5}}, "adabatch.memory.grow_after"),
        (
            {"max_micro_batch_per_gpu": 4, "memory": {"recover_from_oom": False, "predict_peak": True}},
            "adabatch.memory.predict_peak",
        ),
        (
            {"max_micro_batch_per_gpu": 4, "memory": {"predict_peak": False, "peak_margin": 0.2}},
            "adabatch.memory.peak_margin",
        ),
        ({"max_micro_batch_per_gpu": 4, "memory": {"peak_margin": 1.0}}, "adabatch.memory.peak_margin"),
        (
            {"max_micro_batch_per_gpu": 4, "memory": {"device_memory_bytes": 0}},
            "adabatch.memory.device_memory_bytes",
        ),
    ],
)
def test_config_errors_name_the_memory_key(section, path):
    with pytest.raises(ConfigError) as err:
        load_ds_config(_section(**section))
    paths = [p.path for p in err.value.problems]
    assert path in paths, f"expected a problem at {path}, got {paths}"


def test_simulated_memory_limit_forward_backward_and_calls():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    x = torch.randn(8, 3)
    with simulated_memory_limit(4) as budget:
        model(x[:4])
        with pytest.raises(torch.OutOfMemoryError, match="8 samples"):
            model(x)
        budget.max_samples_per_forward = 8
        model(x)
    model(x)  # removed: no limit
    assert budget.raised == 1
    with simulated_memory_limit(4, phase="backward") as budget:
        out = model(x)  # the forward runs
        with pytest.raises(torch.OutOfMemoryError, match="backward"):
            out.sum().backward()
    with simulated_memory_limit(100, fail_calls=[2]) as budget:
        model(x)
        with pytest.raises(torch.OutOfMemoryError):
            model(x)
        model(x)
        assert budget.calls == 3 and budget.raised == 1
    with simulated_memory_limit(1, ranks=[1]):  # this process is rank 0
        model(x)


def test_the_default_memory_section_predicts_with_a_ten_percent_margin():
    memory = load_ds_config(_section(max_micro_batch_per_gpu=4)).adabatch.memory
    assert memory.predict_peak and memory.peak_margin == 0.1 and memory.device_memory_bytes is None
    # predict_peak left at its default does not conflict with recovery switched off
    off = load_ds_config(_section(max_micro_batch_per_gpu=4, memory={"recover_from_oom": False}))
    assert not off.adabatch.memory.recover_from_oom


def test_peak_model_one_size_is_a_line_through_the_origin_then_a_fit_above_every_point():
    model = PeakMemoryModel()
    assert model.largest_fitting(None, 10_000) is None, "nothing observed: no bound"
    model.observe(None, 4, resident=1000, peak=1400)  # 100 B per sample
    assert model.predict(None, 8) == 1800
    assert model.largest_fitting(None, 1650) == 6
    # A second size: activations 50 + 100 x; the line is raised through the highest residual.
    model.observe(None, 2, resident=1000, peak=1250)
    model.observe(None, 4, resident=1000, peak=1450)
    c, b = model.line(None)
    assert b == pytest.approx(100) and c == pytest.approx(50)
    assert model.largest_fitting(None, 1650) == 6 and model.largest_fitting(None, 1649) == 5
    # The resident part follows the last pass (the optimizer allocated its state, a cache was freed).
    model.observe(None, 4, resident=1200, peak=1650)
    assert model.largest_fitting(None, 1650) == 4
    # Keys are separate models (e.g. sequence lengths).
    model.observe(2048, 1, resident=1000, peak=1500)
    assert model.largest_fitting(2048, 2000) == 2 and model.largest_fitting(None, 1650) == 4


def test_a_predicted_bound_caps_the_limit_and_growth_without_a_probe_above_it():
    memory = MicroBatchMemory(16, 16, grow_after_steps=1)
    memory.on_oom(16)  # -> 8
    memory.set_cap(6)
    assert memory.limit == 6, "the planner reads the learned limit capped by the prediction"
    for _ in range(5):
        memory.on_clean_step(6)
    assert memory.limit == 6, "growth stops at the predicted bound"
    saved = memory.state_dict()
    assert "cap" not in saved["keys"]["None"], "the prediction is re-learned, not checkpointed"
    resumed = MicroBatchMemory(16, 16, grow_after_steps=1)
    resumed.load_state_dict(saved)
    assert resumed.limit == 6, "a resumed run plans below the bound its checkpoint ran under (it was 8)"
    memory.set_cap(None)
    memory.on_clean_step(8)
    assert memory.limit > 8, "without a bound the policy grows again"


def test_an_oom_returns_to_the_largest_size_that_ran_not_to_a_limit_no_step_reached():
    """The limit grew 4 -> 6 -> 7 while the schedule ran micro 4 (a batch below the limit): an OOM at 8
    returns to 4, the size that ran clean, not to 7, which never ran."""
    memory = MicroBatchMemory(4, 16, grow_after_steps=1)
    memory.on_oom(8)  # a probe of 8 failed: the limit 4, growth toward 8 in halves
    for _ in range(2):
        memory.on_clean_step(4)
    assert memory.limit == 7
    memory.on_oom(8)
    assert memory.limit == 4
    # Far below the failing size, the size that ran is not returned to: the limit halves, as where
    # nothing is known (a jump from micro 4 to 64 that fails plans 32 next, not 4).
    jump = MicroBatchMemory(64, 64, grow_after_steps=None)
    jump.on_clean_step(4)
    jump.on_oom(64)
    assert jump.limit == 32
    jump.on_oom(32)
    assert jump.limit == 16


def test_an_imposed_failure_lowers_the_limit_over_a_later_checkpoint_and_is_never_probed_again():
    saved = MicroBatchMemory(8, 8, grow_after_steps=1)
    checkpoint = saved.state_dict()  # limit 8: written before the process that failed at 8
    memory = MicroBatchMemory(8, 8, grow_after_steps=1)
    memory.impose(None, 8)
    assert memory.limit == 4
    memory.load_state_dict(checkpoint)
    assert memory.limit == 4, "a checkpoint loaded after the record does not undo it"
    for _ in range(20):
        memory.on_clean_step(memory.limit)
    assert memory.limit == 7, "growth goes up to just below the size that ended a process, never to it"
    fresh = MicroBatchMemory(8, 8, grow_after_steps=1)
    fresh.load_state_dict(memory.state_dict())
    assert fresh.limit == 7, "the bound travels in checkpoints written afterwards"


def test_an_imposed_failure_plans_at_the_largest_size_that_had_run_clean():
    memory = MicroBatchMemory(8, 8, grow_after_steps=1)
    memory.impose(None, 8, good=6)  # the process that failed at 8 had run 6 clean: at least half of 8
    assert memory.limit == 6
    far = MicroBatchMemory(16, 16, grow_after_steps=1)
    far.impose(None, 16, good=3)  # below half: halving, as in the same process
    assert far.limit == 8
    older = new_record(None, 8, rank=0, where="x")
    assert older.good == 0, "a record without the clean size (as older ones) plans by halving"


def test_restart_records_round_trip_and_bad_files_are_skipped(tmp_path):
    first = write_record(
        str(tmp_path), new_record(2048, 8, rank=1, where="in micro-batch 0 of step 3", good=5)
    )
    (tmp_path / "adabatch_oom_rank0.json").write_text("{not json")
    records = read_records(str(tmp_path))
    assert [(p, r.key, r.failed, r.rank, r.good) for p, r in records] == [(first, "2048", 8, 1, 5)]
    remove_records([first, first])
    assert read_records(str(tmp_path)) == []


def test_simulated_memory_counters_and_the_mid_forward_phase():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    seen = []
    model[0].register_forward_hook(lambda *a: seen.append("first layer ran"))
    x = torch.randn(8, 3)
    with simulated_memory_limit(device_memory_bytes=1650, fixed_bytes=1000, bytes_per_sample=100) as mem:
        assert simulated_memory() is mem and mem.total_memory() == 1650
        mem.reset_peak_memory_stats()
        model(x[:4])
        assert mem.memory_allocated() == 1000 and mem.max_memory_allocated() == 1400
        with pytest.raises(torch.OutOfMemoryError, match="1800 needed"):
            model(x)
        assert mem.max_memory_allocated() == 1400, "a pass that failed leaves no peak"
        assert seen == ["first layer ran"], "phase 'forward' fails before the first layer runs"
    assert simulated_memory() is None
    budget = simulated_memory_limit(4, phase="mid_forward")
    with budget, pytest.raises(torch.OutOfMemoryError, match="middle of the forward"):
        model(x)
    assert seen == ["first layer ran"] * 2, "phase 'mid_forward' fails after the first layer ran"
    assert budget.raised == 1
    with pytest.raises(ValueError, match="mid_forward"):
        simulated_memory_limit(4, phase="later")
