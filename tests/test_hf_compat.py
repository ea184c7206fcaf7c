"""The transformers 4.57 ways in (``ds_adabatch/integrations/hf/compat.py``), one process, any release.

The whole Trainer suite runs on 4.57.6 in ``scripts/test_hf_floor.sh``; here, the pieces that answer
4.57's loop arithmetic and token count, and that the mixin is used exactly on 4.x.
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


def test_the_mixin_is_used_exactly_on_4x():
    from ds_adabatch.integrations import AdaptiveBatchSizeTrainer

    legacy = transformers.__version__.startswith("4.")
    assert (compat.Transformers4Loop in AdaptiveBatchSizeTrainer.__mro__) == legacy
    assert AdaptiveBatchSizeTrainer.__name__ == "AdaptiveBatchSizeTrainer"


@pytest.mark.skipif(not transformers.__version__.startswith("4."), reason="a transformers 4.57 argument")
def test_tokens_per_second_is_refused_on_4x(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(str(tmp_path), include_tokens_per_second=True, report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="include_tokens_per_second"):
        compat.check_arguments(args)
