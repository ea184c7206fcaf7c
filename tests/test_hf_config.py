"""``AdaptiveBatchSizeTrainer``'s ``adabatch_config=``, its checks, its logs and its banner, in one process.

Everything here runs without DeepSpeed and without launching ranks: the section given as a dict or a
file (validated as ``ds-adabatch validate`` does, before any process group), what the Trainer refuses
and why, the step-0 answer of a scheduler function, uneven splits, the JSONL of ``adabatch.log``, the
``ds_adabatch`` logger under transformers' verbosity, and the training banner's numbers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from functools import partial

import pytest
import torch

from ds_adabatch.config import ConfigError
from ds_adabatch.integrations.hf.versions import legacy_loop, transformers_4

transformers = pytest.importorskip("transformers")

LEGACY = legacy_loop()
"""transformers 4.57.6 and 5.0-5.2: the one-function loop (its banner has no steps-per-epoch line)."""
ROUNDS = transformers_4()
"""transformers 4.57 logs the loss rounded to 4 decimals."""


@pytest.fixture(autouse=True)
def _deepspeed_flag_per_test(monkeypatch):
    # transformers 4.57's TrainingArguments(deepspeed=...) sets ACCELERATE_USE_DEEPSPEED=true in the
    # process environment for good, and every later TrainingArguments of the process then builds a
    # DeepSpeed plugin: each test starts without it, as its own process would (5.x sets nothing).
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)


def _args(tmp_path, **overrides):
    from hf_worker import _args as quiet_args

    return quiet_args(
        tmp_path, **{"per_device_train_batch_size": 4, "learning_rate": 0.05, "use_cpu": True, **overrides}
    )


def _trainer(tmp_path, *, dataset=None, model=None, args=None, **kwargs):
    from hf_worker import IndexRegression, Regressor, StepRecorder

    from ds_adabatch.integrations import AdaptiveBatchSizeTrainer

    trainer = AdaptiveBatchSizeTrainer(
        model=model if model is not None else Regressor(),
        args=args if args is not None else _args(tmp_path, num_train_epochs=1),
        train_dataset=dataset if dataset is not None else IndexRegression(24),
        **kwargs,
    )
    recorder = StepRecorder(trainer)
    trainer.add_callback(recorder)
    return trainer, recorder


def _plans(recorder) -> list[list[int]]:
    return [s["plan"] for s in recorder.steps]


# -- adabatch_config= without DeepSpeed ----------------------------------------------------------------
def test_a_config_schedule_drives_the_batch_without_deepspeed(tmp_path):
    from hf_worker import IndexRegression

    section = {
        "schedule": {"type": "step", "start": 4, "end": 10, "increment": 3, "ramp_samples": 12},
        "max_micro_batch_per_gpu": 3,
        "granularity": 2,
        "allow_uneven": True,
        "max_global_batch": 10,
    }
    path = tmp_path / "section.json"
    path.write_text(json.dumps(section))
    trainer, rec = _trainer(tmp_path, adabatch_config=str(path), dataset=IndexRegression(40))
    trainer.train()
    sizes = [p[0] for p in _plans(rec)]
    # Megatron-style steps 4 -> 7 -> 10 rounded to multiples of 2 (granularity), at most 10.
    assert sizes[0] == 4 and max(sizes) == 10 and all(s % 2 == 0 for s in sizes[:-1]), sizes
    assert sum(sizes) == 40, f"every sample once: {sizes}"
    assert all(p[1] <= 3 for p in _plans(rec)), f"max_micro_batch_per_gpu 3 not honoured: {_plans(rec)}"
    uneven = [p for p in _plans(rec) if p[0] == 10]
    assert uneven == [[10, 3, 4]] * len(uneven), f"10 samples, at most 3 per pass, uneven: {uneven}"


def test_the_section_is_checked_before_any_process_group(tmp_path):
    from hf_worker import IndexRegression, Regressor

    from ds_adabatch.integrations import AdaptiveBatchSizeTrainer

    bad = {
        "schedule": {"type": "linear", "start": 8, "end": 4, "ramp_samples": 0},
        "max_micro_batch_per_gpu": 0,
    }
    with pytest.raises(ConfigError) as err:
        AdaptiveBatchSizeTrainer(
            model=Regressor(), args=_args(tmp_path), train_dataset=IndexRegression(), adabatch_config=bad
        )
    assert {"adabatch.max_micro_batch_per_gpu", "adabatch.schedule"} <= set(err.value.paths), err.value
    assert not torch.distributed.is_initialized(), "the error came after a process group started"


@pytest.mark.parametrize(
    ("section", "scheduler", "paths"),
    [
        (
            {"schedule": {"type": "constant", "value": 8}, "max_micro_batch_per_gpu": 4},
            True,
            {"adabatch.schedule"},
        ),
        ({"max_micro_batch_per_gpu": "auto"}, True, {"adabatch.max_micro_batch_per_gpu"}),
        (
            {"max_micro_batch_per_gpu": 4, "memory": {"grow_after_steps": 5}},
            True,
            {"adabatch.memory.grow_after_steps"},
        ),
        (
            {"schedule": {"type": "gradient_noise", "start": 8}, "max_micro_batch_per_gpu": 4},
            False,
            {"adabatch.schedule.type"},
        ),
        ({"max_micro_batch_per_gpu": 4}, False, {"adabatch.schedule"}),
    ],
    ids=[
        "schedule_and_function",
        "auto_without_deepspeed",
        "memory_without_deepspeed",
        "noise_without_deepspeed",
        "no_schedule",
    ],
)
def test_keys_the_trainer_cannot_honour_are_refused_with_their_path(tmp_path, section, scheduler, paths):
    from hf_worker import IndexRegression, Regressor

    from ds_adabatch.integrations import AdaptiveBatchSizeTrainer

    with pytest.raises(ConfigError) as err:
        AdaptiveBatchSizeTrainer(
            batch_size_scheduler=(lambda step, batch: batch) if scheduler else None,
            model=Regressor(),
            args=_args(tmp_path),
            train_dataset=IndexRegression(),
            adabatch_config=section,
        )
    assert set(err.value.paths) == paths, str(err.value)


def test_the_same_section_twice_is_accepted_and_two_different_ones_refused(tmp_path):
    from hf_worker import ds_config

    section = {"schedule": {"type": "constant", "value": 4}, "max_micro_batch_per_gpu": 2}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config(section)))
    args = _args(tmp_path, deepspeed=str(path))
    from ds_adabatch.integrations.hf.config import read_trainer_section

    assert read_trainer_section(str(path), args.deepspeed, has_scheduler=False).config.schedule.value == 4
    other = {**section, "max_micro_batch_per_gpu": 1}
    with pytest.raises(ValueError, match="two different adabatch sections"):
        read_trainer_section(other, args.deepspeed, has_scheduler=False)


# -- the scheduler function: its unit, its first answer, its name -----------------------------------------
def test_the_first_batch_is_the_functions_answer_at_step_zero(tmp_path):
    calls = []

    def start_at_six(step: int, batch_size: int) -> int:
        calls.append((step, batch_size))
        return 6 if step == 0 else batch_size

    args = _args(tmp_path, max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    trainer, rec = _trainer(tmp_path, args=args, batch_size_scheduler=start_at_six)
    trainer.train()
    assert calls[0] == (0, 8), f"step 0 is asked with per_device x GAS: {calls}"
    assert _plans(rec) == [[6, 3, 2], [6, 3, 2]], f"6 samples per device, at most 4 per pass: {_plans(rec)}"
    schedule = trainer.batch_state.controller.state_dict()["schedule"]
    assert schedule["function"].endswith(
        ":test_the_first_batch_is_the_functions_answer_at_step_zero.<locals>.start_at_six"
    )


def test_a_partial_is_named_by_its_function_and_called_with_its_keywords(tmp_path):
    from hf_worker import custom_batch_size_scheduler

    scheduler = partial(custom_batch_size_scheduler, interval=2, increment=3)
    trainer, rec = _trainer(
        tmp_path,
        args=_args(tmp_path, max_steps=5, per_device_train_batch_size=1),
        batch_size_scheduler=scheduler,
    )
    trainer.train()
    assert [p[0] for p in _plans(rec)] == [1, 1, 4, 4, 7]
    state = trainer.batch_state.state_dict(trainer.state.global_step)
    assert state["controller"]["schedule"]["function"] == "hf_worker:custom_batch_size_scheduler"
    assert "keep_batch_size" not in json.dumps(state), "the stand-in schedule leaked into the checkpoint"


def _keyword_only(step: int, batch_size: int, *, interval: int, increment: int) -> int:
    return batch_size + increment if step % interval == 0 and step > 0 else batch_size


def test_a_partial_supplies_arguments_without_defaults_and_a_function_that_cannot_take_the_call_is_named(
    tmp_path,
):
    from ds_adabatch.integrations import AdaptiveBatchSizeTrainer

    args = _args(tmp_path, max_steps=5, per_device_train_batch_size=1)
    trainer, rec = _trainer(
        tmp_path, args=args, batch_size_scheduler=partial(_keyword_only, interval=2, increment=3)
    )
    trainer.train()
    assert [p[0] for p in _plans(rec)] == [1, 1, 4, 4, 7]
    with pytest.raises(ConfigError) as err:
        from hf_worker import IndexRegression, Regressor

        AdaptiveBatchSizeTrainer(
            model=Regressor(),
            args=args,
            train_dataset=IndexRegression(24),
            batch_size_scheduler=lambda step: 8,
        ).train()
    assert err.value.paths == ["batch_size_scheduler"] and "keep_batch_size" not in str(err.value), str(
        err.value
    )


def test_without_a_section_a_rank_splits_unevenly_rather_than_one_sample_per_pass(tmp_path):
    # 5 samples per device at most 4 per pass: 3 + 2, not 1 x 5.
    args = _args(tmp_path, max_steps=2, per_device_train_batch_size=4)
    trainer, rec = _trainer(tmp_path, args=args, batch_size_scheduler=lambda step, batch: 5)
    trainer.train()
    assert [s["sizes"] for s in rec.steps] == [[3, 2], [3, 2]], [s["sizes"] for s in rec.steps]


def test_a_section_without_allow_uneven_warns_before_a_step_of_single_samples(tmp_path):
    args = _args(tmp_path, max_steps=2, per_device_train_batch_size=4)
    trainer, rec = _trainer(
        tmp_path,
        args=args,
        batch_size_scheduler=lambda step, batch: 5,
        adabatch_config={"max_micro_batch_per_gpu": 4},
    )
    with _transformers_lines() as lines:
        trainer.train()
    assert _plans(rec) == [[5, 1, 5], [5, 1, 5]]
    warned = [line for line in lines if "micro-batches of 1 sample" in line]
    assert len(warned) == 1, f"one warning per global batch: {warned}"
    assert warned[0].startswith("[ds_adabatch] step 0: global batch 5 runs as micro-batches of 1 sample")
    assert '"allow_uneven": true' in warned[0] and "micro-batches of 3, 2 passes" in warned[0], warned[0]


# -- adabatch.log.jsonl -------------------------------------------------------------------------------
def test_the_jsonl_log_has_every_step_with_its_global_mean_loss(tmp_path):
    path = tmp_path / "steps.jsonl"
    section = {
        "schedule": {"type": "linear", "start": 2, "end": 6, "ramp_samples": 12},
        "max_micro_batch_per_gpu": 2,
        "allow_uneven": True,
        "log": {"jsonl": str(path), "every_steps": 3},
    }
    trainer, rec = _trainer(tmp_path, adabatch_config=section, args=_args(tmp_path, num_train_epochs=2))
    trainer.train()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, trainer.state.global_step + 1))
    logged = {e["step"]: e["loss"] for e in trainer.state.log_history if "train_coverage" in e}
    for r, plan in zip(records, _plans(rec)):
        # transformers 4.57 logs the loss rounded to 4 decimals; 5.x as computed.
        assert r["loss"] == pytest.approx(logged[r["step"]], rel=1e-6, abs=5e-5 if ROUNDS else 0)
        assert [r["global_batch"], r["micro_batch_per_gpu"], r["gradient_accumulation_steps"]] == plan
    assert records[-1]["samples"] == 48 and records[-1]["epoch"] == pytest.approx(2.0)
    assert all(r["grad_norm"] is not None and math.isfinite(r["lr"]) for r in records)


# -- logging through transformers ------------------------------------------------------------------------
@contextlib.contextmanager
def _transformers_lines():
    """The messages transformers' library logger handles (what its handler prints), its verbosity
    restored afterwards."""
    from transformers.utils import logging as hf_logging

    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler, before = Lines(), hf_logging.get_verbosity()
    logging.getLogger("transformers").addHandler(handler)
    try:
        yield lines
    finally:
        logging.getLogger("transformers").removeHandler(handler)
        hf_logging.set_verbosity(before)


def test_plan_changes_follow_transformers_verbosity(tmp_path):
    from transformers.utils import logging as hf_logging

    section = {
        "schedule": {"type": "linear", "start": 2, "end": 6, "ramp_samples": 12},
        "max_micro_batch_per_gpu": 2,
    }
    for level, shown in ((hf_logging.INFO, True), (hf_logging.WARNING, False)):
        with _transformers_lines() as lines:
            trainer, _ = _trainer(tmp_path, adabatch_config=section, args=_args(tmp_path, max_steps=3))
            hf_logging.set_verbosity(level)  # after the Trainer set its own (log_level passive)
            trainer.train()
        text = "\n".join(lines)
        assert ("[ds_adabatch] step 1: global batch 2 -> " in text) is shown, (level, text[-2000:])
        assert ("***** Running training *****" in text) is shown, "transformers' own INFO lines disagree"
        # The warning about single-sample passes shows at both levels.
        assert "[ds_adabatch] step 1: global batch 3 runs as micro-batches of 1 sample" in text, text[-2000:]


def test_the_logger_is_routed_only_while_training_and_left_alone_when_configured():
    from ds_adabatch.integrations.hf.logs import follow_transformers_logging

    logger = logging.getLogger("ds_adabatch")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    try:
        logger.handlers, logger.level, logger.propagate = [], logging.NOTSET, True
        with follow_transformers_logging():
            assert len(logger.handlers) == 1 and not logger.propagate
        assert logger.handlers == [] and logger.level == logging.NOTSET and logger.propagate, "not restored"
        logger.setLevel(logging.ERROR)
        with follow_transformers_logging():
            assert logger.handlers == [] and logger.level == logging.ERROR and logger.propagate
    finally:
        logger.handlers, logger.level, logger.propagate = saved


# -- the banner -------------------------------------------------------------------------------------------
def test_the_banner_and_state_give_replayed_steps_epochs_and_gas(tmp_path):

    section = {
        "schedule": {"type": "linear", "start": 2, "end": 8, "ramp_samples": 24},
        "max_micro_batch_per_gpu": 2,
    }
    with _transformers_lines() as lines:
        trainer, rec = _trainer(
            tmp_path, adabatch_config=section, args=_args(tmp_path, max_steps=9, log_level="info")
        )
        trainer.train()
    text = "\n".join(lines)
    first_epoch = sum(1 for s in rec.steps if s["epoch"] <= 1.0 + 1e-9)
    epochs = math.ceil(rec.steps[-1]["epoch"] - 1e-9)
    if not LEGACY:  # the one-function loop's banner has no steps-per-epoch line (ds_adabatch's says it)
        assert f"Num update steps per epoch = {first_epoch} in the first epoch" in text, text
    assert f"optimizer steps per epoch: {first_epoch} in the first epoch" in text, text
    assert f"Num Epochs = {epochs} (estimated from the schedule)" in text and "9,223,372" not in text
    assert f"Gradient Accumulation steps = {rec.steps[0]['plan'][2]} at the first step" in text
    assert trainer.state.num_train_epochs == epochs and trainer.state.max_steps == 9
    assert (
        trainer.args.gradient_accumulation_steps == 1
        and type(trainer.args.gradient_accumulation_steps) is int
    )


def test_token_budgets_work_without_deepspeed(tmp_path):
    from hf_worker import TOKEN_BUDGET, TOKEN_SECTION, VariableLengthText, lm_collator, token_gpt2

    dataset = VariableLengthText()
    passes: list[int] = []
    collate = lm_collator()

    def counted(samples):
        batch = collate(samples)
        passes.append(batch["input_ids"].numel())
        return batch

    trainer, rec = _trainer(
        tmp_path,
        model=token_gpt2(),
        dataset=dataset,
        args=_args(tmp_path, num_train_epochs=1, per_device_train_batch_size=1),
        adabatch_config=TOKEN_SECTION,
        data_collator=counted,
    )
    trainer.train()
    trained = sorted(i for s in rec.steps for m in s["indices"] for i in m)
    assert trained == list(range(len(dataset))), "every sample once in the epoch"
    assert passes and max(passes) <= TOKEN_BUDGET, f"a pass held {max(passes)} padded tokens"
    assert trainer.state.log_history[-2]["train_tokens"] == sum(len(dataset[i]["input_ids"]) for i in trained)


def test_the_sections_data_keys_win_over_training_arguments(tmp_path):
    from hf_worker import IndexRegression

    section = {
        "schedule": {"type": "constant", "value": 4},
        "max_micro_batch_per_gpu": 4,
        "data": {"shuffle": False, "drop_last": True},
    }
    args = _args(tmp_path, num_train_epochs=1, dataloader_drop_last=False)
    trainer, rec = _trainer(tmp_path, args=args, adabatch_config=section)
    trainer.train()
    trained = [i for s in rec.steps for m in s["indices"] for i in m]
    assert trained == list(range(24)), f"data.shuffle false: the dataset's order, got {trained}"
    trainer, rec = _trainer(tmp_path, args=args, adabatch_config=section, dataset=IndexRegression(22))
    trainer.train()
    assert sum(s["plan"][0] for s in rec.steps) == 20, "data.drop_last true: the 2-sample tail is skipped"


def test_drop_last_with_a_batch_beyond_the_dataset_is_refused_naming_the_argument(tmp_path):
    section = {
        "schedule": {"type": "linear", "start": 4, "end": 32, "ramp_samples": 24},
        "max_micro_batch_per_gpu": 4,
    }
    args = _args(tmp_path, num_train_epochs=1, dataloader_drop_last=True)
    with pytest.raises(ConfigError) as err:
        trainer, _ = _trainer(tmp_path, args=args, adabatch_config=section)
        trainer.train()
    msg = str(err.value)
    assert "adabatch.schedule.end" in msg and "24 samples" in msg and "dataloader_drop_last" in msg, msg


def test_caller_owned_accumulation_is_refused_by_the_trainer(tmp_path):
    # accelerate steps DeepSpeed after every backward: each micro-batch would be an update of its own.
    from hf_worker import ds_config

    from ds_adabatch.integrations.hf.config import read_trainer_section

    section = {"schedule": {"type": "constant", "value": 4}, "max_micro_batch_per_gpu": 2}
    config = {**ds_config(section), "managed_gradient_accumulation": False}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    for deepspeed in (config, str(path)):
        with pytest.raises(ConfigError) as err:
            read_trainer_section(None, deepspeed, has_scheduler=False)
        assert set(err.value.paths) == {"managed_gradient_accumulation"}, str(err.value)
        assert "remove the key" in str(err.value)
    managed = {**config, "managed_gradient_accumulation": True}
    assert read_trainer_section(None, managed, has_scheduler=False).config.schedule.value == 4


def test_an_arch_list_deepspeed_cannot_build_with_is_refused_when_the_trainer_is_built(tmp_path, monkeypatch):
    """The DeepSpeed config's own optimizer is JIT-built on a GPU at the first train(); a
    TORCH_CUDA_ARCH_LIST entry DeepSpeed 0.19.8 cannot read ("9.0a") is named when the Trainer is
    constructed, as ``ds_adabatch.initialize`` names it, not met later as a bare ValueError."""
    import deepspeed.accelerator
    from hf_worker import IndexRegression, Regressor, ds_config

    from ds_adabatch.integrations import AdaptiveBatchSizeTrainer

    section = {"schedule": {"type": "constant", "value": 4}, "max_micro_batch_per_gpu": 2}
    with_adam = _args(tmp_path, deepspeed=ds_config(section, with_optimizer=True))
    without = _args(tmp_path, deepspeed=ds_config(section))

    class _Cuda:
        def device_name(self):
            return "cuda"

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", _Cuda)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    with pytest.raises(ConfigError) as err:
        AdaptiveBatchSizeTrainer(model=Regressor(), args=with_adam, train_dataset=IndexRegression())
    assert err.value.paths == ["optimizer.type"], str(err.value)
    assert "TORCH_CUDA_ARCH_LIST='9.0'" in str(err.value) and "TrainingArguments(deepspeed=" in str(err.value)
    assert not torch.distributed.is_initialized(), "the error came after a process group started"

    from ds_adabatch.integrations.hf.config import deepspeed_build_problems

    # Without the optimizer section the Trainer hands DeepSpeed a torch optimizer: nothing is built.
    assert deepspeed_build_problems(without.deepspeed) == []
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert deepspeed_build_problems(with_adam.deepspeed) == []
