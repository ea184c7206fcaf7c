"""The ways into transformers' one-function loop and the plain Trainer's fixes before 5.18
(``ds_adabatch/integrations/hf/compat.py``), one process, any release.

The Trainer's focused suite runs on 4.57.6, 5.0.0, 5.2.0, 5.3.0 and 5.17.0 in
``scripts/test_hf_floor.sh``; here, the pieces that answer the one-function loop's arithmetic and token
count, and that each release adapter is held exactly on the releases that behave as it assumes.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402

from ds_adabatch.data.loader import MicroBatch, StepBatch  # noqa: E402
from ds_adabatch.integrations.hf import compat  # noqa: E402
from ds_adabatch.plan import plan_batch  # noqa: E402


def test_the_resumed_epoch_is_the_streams_and_nothing_is_skipped():
    epochs = {0: 0, 5: 0, 6: 1, 13: 2}
    bound = compat.StepsPerEpoch(40, lambda: "7 in the first epoch, then 6", epochs.__getitem__)
    for step, epoch in epochs.items():
        # transformers 4.57 Trainer._inner_training_loop: int(global_step // steps_per_epoch) and
        # global_step % steps_per_epoch (batches to skip).
        assert int(step // bound) == epoch and step % bound == 0, (step, step // bound, step % bound)
    assert int(bound) == 40 and f"{bound:,}" == "7 in the first epoch, then 6"


def _step(*batches, pads=()):
    plan = plan_batch(4, 1, 2)
    micro = tuple(
        MicroBatch(b, () if i in pads else tuple(range(len(b["input_ids"]))), 0 if i in pads else 2)
        for i, b in enumerate(batches)
    )
    return StepBatch(micro, plan, 0, 0, None)


def test_the_token_count_sees_the_real_micro_batches_flat():
    a = {
        "input_ids": torch.ones(2, 5, dtype=torch.long),
        "attention_mask": torch.tensor([[1] * 5, [1, 1, 0, 0, 0]]),
    }
    b = {
        "input_ids": torch.ones(2, 3, dtype=torch.long),
        "attention_mask": torch.ones(2, 3, dtype=torch.long),
    }
    pad = {
        "input_ids": torch.ones(1, 9, dtype=torch.long),
        "attention_mask": torch.ones(1, 9, dtype=torch.long),
    }
    inputs = compat.CountedStepInputs(_step(a, b, pad, pads=(2,)))
    assert "input_ids" in inputs and "attention_mask" in inputs and "labels" not in inputs
    # 4.57 counts inputs[main].numel() ("all") or inputs["attention_mask"].sum() ("non_padding").
    assert inputs["input_ids"].numel() == 10 + 6, "the pad's 9 tokens are not counted"
    assert int(inputs["attention_mask"].sum()) == 7 + 6


def test_the_loop_adapter_is_used_exactly_where_the_loop_is_one_function():
    from ds_adabatch.integrations import AdaptiveBatchSizeTrainer

    # 5.3 split the loop into _init_training_state / _prepare_for_training / _run_epoch.
    one_function = not hasattr(transformers.Trainer, "_prepare_for_training")
    assert (compat.loop_for() is compat.OneFunctionLoop) == one_function
    assert AdaptiveBatchSizeTrainer.__name__ == "AdaptiveBatchSizeTrainer"
    assert AdaptiveBatchSizeTrainer.__mro__[1] is transformers.Trainer, "no class between it and the Trainer"


def test_the_split_loop_adds_nothing_and_the_one_function_loop_answers_for_the_stream():
    from types import SimpleNamespace

    from ds_adabatch.integrations.hf.data import StepInputs

    # The Trainer's own methods, as the trainer's super() offers them on 5.x.
    parent = SimpleNamespace(
        get_cp_size=lambda: 3, get_sp_size=lambda: 2, get_total_train_batch_size=lambda args: 64
    )
    state = SimpleNamespace(initial_plan=plan_batch(24, 1, 8))
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(parallelism_config=None), _require_state=lambda: state
    )
    split, one = compat.SplitLoop(trainer), compat.OneFunctionLoop(trainer)

    def sizes(adapter):
        return adapter.cp_size(parent), adapter.sp_size(parent), adapter.total_train_batch_size(parent, None)

    assert sizes(split) == (3, 2, 64), "5.3+: the Trainer's own answers"
    # 4.57 has no parallelism config and prints the first step's global batch as the total batch.
    assert sizes(one) == (1, 1, 24)
    items = [StepInputs(_step({"input_ids": torch.ones(2, 3, dtype=torch.long)}))]
    assert split.step_items(items) is items
    counted = one.step_items(items)
    assert [type(i) for i in counted] == [compat.CountedStepInputs] and counted[0].step is items[0].step
    for adapter, bound in ((split, False), (one, True)):
        loader = SimpleNamespace(len_is_bound=False)
        adapter.loader_made(loader)
        assert loader.len_is_bound is bound, "4.57 reads len(loader) once per epoch: a bound"


def _filled_warmup(tmp_path) -> object:
    """What this release's deepspeed_init writes into an "auto" warmup_num_steps without a warmup."""
    from transformers import TrainingArguments

    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 0},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
    }
    args = TrainingArguments(str(tmp_path), deepspeed=ds, warmup_steps=0, report_to=[], use_cpu=True)
    assert compat.auto_warmup(args)
    config = args.hf_deepspeed_config
    config.trainer_config_finalize(args, torch.nn.Linear(2, 2), 10)  # as deepspeed_init calls it
    return config.get_value("scheduler.params.warmup_num_steps")


def test_the_fixes_are_held_exactly_where_the_release_fills_a_zero_warmup(tmp_path, monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    filled = _filled_warmup(tmp_path)
    assert filled in (0, 1), filled
    assert (compat.fixes_for() is compat.PlainTrainerFixes) == (filled == 0)


@pytest.mark.skipif(not transformers.__version__.startswith("4."), reason="a transformers 4.57 argument")
def test_tokens_per_second_is_refused_on_4x(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(str(tmp_path), include_tokens_per_second=True, report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="include_tokens_per_second"):
        compat.check_arguments(args)
