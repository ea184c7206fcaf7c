"""AdaptiveBatchSizeTrainer checks on real gloo ranks, run under torchrun by tests/test_hf_trainer.py.

Usage: torchrun --nproc-per-node N tests/hf_worker.py OUT_DIR {ds|zero3|ddp} SCENARIO [SCENARIO ...]

``ds`` is DeepSpeed ZeRO-2, ``zero3`` DeepSpeed ZeRO-3, ``ddp`` the Trainer without DeepSpeed.

Scenarios (each writes OUT_DIR/<scenario>_<backend>_rank<r>.json; pytest asserts on them):

* ``seed``: the seed's scheduler (+1 sample per device every 5 steps) for 4 epochs of 10 samples, with
  the default ``use_cpu=False`` (the duplicate-training fix must make the ranks one group), saving a
  checkpoint after step 6; then a second trainer resumes from it and runs to the end.
* ``exact``: one optimizer step of a tiny GPT-2 (labels partly -100) with the same global batch split
  as 1 x 8 and 4 x 2 (and, with DeepSpeed, unevenly and with a zero-weight pad), compared with a
  plain-PyTorch big-batch SGD step.
* ``models``: a BERT classifier (forward takes ``**kwargs``, loss ignores ``num_items_in_batch``), a
  GPT-2 LM (honours it) and a module without ``**kwargs``, each at GAS 1, GAS 4 and a GAS that
  changes every step: every step's applied gradient (SGD, lr 1) and logged loss against plain PyTorch.
* ``ramp``: no scheduler; the DeepSpeed config's "adabatch" section ramps the global batch.
* ``noise``: the ``gradient_noise`` schedule from the "adabatch" section: the estimate against a
  closed form (ZeRO 0 and the backend's stage), the batch following it, and a resume continuing it.
* ``world`` (DeepSpeed only): a constant global batch of 4 from the config's section (the same on any
  number of ranks), AdamW under DeepSpeed's warm-up-decay schedule, 6 steps, checkpoints after steps 3
  and 6, the parameters after every step. With ``HF_RESUME_FROM`` set (a JSON object of ZeRO stage to
  the checkpoint another number of ranks wrote), each stage's run resumes from there instead, from other
  initial weights: the steps after the checkpoint must follow the same parameters.
* ``tokens`` (DeepSpeed only: ``micro_batch_tokens`` lives in its config): a GPT-2 built from a config on
  sequences of 3..20 tokens, padded to the longest by ``DataCollatorForLanguageModeling``, with token
  budgets of 40 per pass and a linear ``unit: "tokens"`` ramp for 2 epochs; every forward pass's
  ``input_ids.numel()``, every step's samples and parameters, a checkpoint after step 4 and a resumed
  second run; the same run again with rank 1 out of memory above 30 tokens per pass (recovered by
  re-cutting the step); then 10-sample steps of a BERT classifier cut by a token budget. Every rank
  also replays the steps in plain PyTorch (one padded batch per step, SGD at the LR the token target
  implies) for the parameter comparisons.

The helpers (datasets, model builders, the recording callback) are also used by the single-process
tests in tests/test_hf_trainer.py.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from engine_worker import NOISE_DIM, NOISE_ESTIMATE  # noqa: E402
from engine_worker import GaussianRegression as _GaussianPairs  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    DataCollatorForLanguageModeling,
    DataCollatorWithPadding,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    TrainerCallback,
    TrainingArguments,
)

import ds_adabatch  # noqa: E402
from ds_adabatch.integrations import AdaptiveBatchSizeTrainer  # noqa: E402
from ds_adabatch.testing import simulated_memory_limit  # noqa: E402

SEED_SAMPLES = 10
SEED_EPOCHS = 4
SAVE_AT = 6
EXACT_SAMPLES = 32
SEQ = 12
LR = 0.5
ZERO_STAGE = 2
"""DeepSpeed ZeRO stage of the configs built here (the ``zero3`` backend sets 3)."""


def custom_batch_size_scheduler(step: int, batch_size: int, interval: int = 5, increment: int = 1) -> int:
    """The seed's README scheduler, verbatim in behaviour."""
    if step % interval == 0 and step > 0:
        return batch_size + increment
    return batch_size


class IndexRegression(torch.utils.data.Dataset):
    """Sample i is the point (i/10, 1) -> i/10: a model whose loss depends on which samples it saw."""

    def __init__(self, n: int = SEED_SAMPLES) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor([i / 10, 1.0]), "labels": torch.tensor(i / 10)}


class Regressor(torch.nn.Module):
    """A linear model with a mean-squared-error loss (no **kwargs: the Trainer normalises by samples)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": ((self.linear(x).squeeze(-1) - labels) ** 2).mean()}


class TokenWindows(torch.utils.data.Dataset):
    """Byte windows whose labels end in -100 runs of different lengths (samples differ in tokens)."""

    def __init__(self, n: int = EXACT_SAMPLES, seq: int = SEQ) -> None:
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 256, (n, seq), generator=g)
        self.keep = [2 + (i * 5) % (seq - 1) for i in range(n)]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[self.keep[i] :] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=256, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)


def flat(model: torch.nn.Module) -> torch.Tensor:
    """All parameters as one float64 vector (gathered first where ZeRO-3 partitioned them; collective)."""
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return torch.cat([p.detach().reshape(-1).double() for p in params])
    return torch.cat([p.detach().reshape(-1).double() for p in params])


class StepRecorder(TrainerCallback):
    """Records, per optimizer step, what this rank trained and where the sample stream stands."""

    def __init__(self, trainer: AdaptiveBatchSizeTrainer) -> None:
        self.trainer = trainer
        self.steps: list[dict[str, Any]] = []

    def on_step_end(self, args, state, control, **kwargs) -> None:
        bs = self.trainer.batch_state
        step = bs.last_step
        self.steps.append(
            {
                "step": state.global_step,
                "sizes": [m.num_samples for m in step.micro_batches],
                "indices": [list(m.indices) for m in step.micro_batches],
                "coverage": bs.train_coverage,
                "epoch": state.epoch,
                "plan": [
                    step.plan.global_batch_size,
                    step.plan.micro_batch_per_gpu,
                    step.plan.gradient_accumulation_steps,
                ],
                "workers": len(bs.loader.worker_processes()),
            }
        )


def ds_config(adabatch: dict | None = None, *, with_optimizer: bool = False) -> dict:
    cfg: dict[str, Any] = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        # Under ZeRO-3 every parameter is partitioned, however small (the default keeps small ones whole).
        "zero_optimization": {"stage": ZERO_STAGE, "stage3_param_persistence_threshold": 0}
        if ZERO_STAGE == 3
        else {"stage": ZERO_STAGE},
        "steps_per_print": 10**9,
    }
    if with_optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
        cfg["scheduler"] = {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        }
    if adabatch is not None:
        cfg["adabatch"] = adabatch
    return cfg


def _args(out: Path, **kw: Any) -> TrainingArguments:
    base = {
        "output_dir": str(out),
        "report_to": [],
        "disable_tqdm": True,
        "logging_steps": 1,
        "save_strategy": "no",
    }
    return TrainingArguments(**{**base, **kw})


def run_seed(out: Path, ds: bool, *, use_cpu: bool = False, extra_args: dict | None = None) -> dict:
    """The seed's scheduler for 4 epochs, a checkpoint after step 6, then a resumed second run."""
    common = {
        "per_device_train_batch_size": 1,
        "num_train_epochs": SEED_EPOCHS,
        "learning_rate": 0.05,
        "warmup_steps": 2,
        "seed": 11,
        "use_cpu": use_cpu,
        "deepspeed": ds_config(with_optimizer=True) if ds else None,
        **(extra_args or {}),
    }
    scheduler = partial(custom_batch_size_scheduler, interval=5, increment=1)
    first = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=scheduler,
        model=Regressor(),
        args=_args(out / "first", save_strategy="steps", save_steps=SAVE_AT, **common),
        train_dataset=IndexRegression(),
    )
    rec1 = StepRecorder(first)
    first.add_callback(rec1)
    first.train()
    second = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=scheduler,
        model=Regressor(seed=5),  # other weights: the checkpoint must restore them
        args=_args(out / "second", **common),
        train_dataset=IndexRegression(),
    )
    rec2 = StepRecorder(second)
    second.add_callback(rec2)
    second.train(resume_from_checkpoint=str(out / "first" / f"checkpoint-{SAVE_AT}"))
    return {
        "world_size": first.args.world_size,
        "first": rec1.steps,
        "second": rec2.steps,
        "first_logs": first.state.log_history,
        "second_logs": second.state.log_history,
        "checkpoints": sorted(p.name for p in (out / "first").iterdir() if p.name.startswith("checkpoint-")),
        "final_param_diff": float((flat(first.model) - flat(second.model)).abs().max()),
        "max_steps": [first.state.max_steps, second.state.max_steps],
    }


def reference_step(model: torch.nn.Module, samples: list[dict]) -> torch.Tensor:
    """Plain PyTorch: one SGD step on the mean loss over all samples' target tokens (or samples)."""
    model = copy.deepcopy(model)
    batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
    model(**batch)["loss"].backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return flat(model)


def run_exact(out: Path, ds: bool) -> dict:
    """One SGD step with one global batch split several ways, against a big-batch reference.

    GPT-2 cases normalise by target tokens (the Trainer's num_items_in_batch path); the regression
    cases by samples. Uneven splits need the "adabatch" section (allow_uneven), so DeepSpeed only.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_rank = 8
    cases: dict[str, tuple[dict, int, bool]] = {"1x8": ({}, 1, True), "4x2": ({}, 4, True)}
    if ds:
        cases["uneven"] = ({"allow_uneven": True}, 3, True)
        cases["uneven_sample"] = ({"allow_uneven": True}, 3, False)
        cases["padded"] = ({"allow_uneven": True}, 1, True)
    results: dict[str, Any] = {}
    params: dict[str, torch.Tensor] = {}
    for name, (extra, max_micro, by_token) in cases.items():
        data = TokenWindows() if by_token else IndexRegression(EXACT_SAMPLES)
        # Uneven: 14 samples on 2 ranks as 3+2+2 | 3+2+2; padded: 3 samples as 1+1 | 1+pad.
        batch = 3 if name == "padded" else per_rank * world - (2 if extra else 0)
        model = tiny_gpt2() if by_token else Regressor()
        start = copy.deepcopy(model)
        adabatch = {
            "schedule": {"type": "constant", "value": batch},
            "max_micro_batch_per_gpu": max_micro,
            **extra,
        }
        args = _args(
            out / f"exact_{name}",
            max_steps=1,
            per_device_train_batch_size=per_rank,
            learning_rate=LR,
            optim="sgd",
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            weight_decay=0.0,
            use_cpu=True,
            deepspeed=ds_config(adabatch) if ds else None,
        )
        trainer = AdaptiveBatchSizeTrainer(
            model=model, args=args, train_dataset=data, max_micro_batch_per_gpu=None if ds else max_micro
        )
        trainer.train()
        plan = trainer.batch_state.plan
        chosen = trainer.batch_state.last_step.global_batch.all_indices()
        after = flat(trainer.model)
        reference = reference_step(start, [data[i] for i in chosen])
        params[name] = after
        results[name] = {
            "plan": [plan.global_batch_size, plan.micro_batch_per_gpu, plan.gradient_accumulation_steps],
            "sizes": [m.num_samples for m in trainer.batch_state.last_step.micro_batches],
            "diff_vs_reference": float((after - reference).abs().max()),
            "update": float((after - flat(start)).abs().max()),
        }
    results["diff_1x8_vs_4x2"] = float((params["1x8"] - params["4x2"]).abs().max())
    return results


class Sentences(torch.utils.data.Dataset):
    """Token sequences with a class label each (for a sequence classifier)."""

    def __init__(self, n: int = EXACT_SAMPLES, seq: int = SEQ) -> None:
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, 256, (n, seq), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones(SEQ, dtype=torch.long),
            "labels": self.labels[i],
        }


def tiny_bert(seed: int = 0) -> BertForSequenceClassification:
    """A BERT classifier from a config: its forward takes **kwargs, its loss ignores num_items_in_batch."""
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=256,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=SEQ,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config)


class ParamRecorder(TrainerCallback):
    """Records, per optimizer step, the global batch's samples and all parameters after the update."""

    def __init__(self, trainer: AdaptiveBatchSizeTrainer) -> None:
        self.trainer = trainer
        self.steps: list[tuple[list[int], torch.Tensor, list[int]]] = []

    def on_step_end(self, args, state, control, **kwargs) -> None:
        step = self.trainer.batch_state.last_step
        plan = step.plan
        shape = [plan.global_batch_size, plan.micro_batch_per_gpu, plan.gradient_accumulation_steps]
        self.steps.append((step.global_batch.all_indices(), flat(self.trainer.model), shape))


MODELS = {
    "bert": (tiny_bert, Sentences),
    "gpt2": (tiny_gpt2, TokenWindows),
    "plain": (Regressor, lambda: IndexRegression(EXACT_SAMPLES)),
}
SPLITS = {
    # per-device samples of each optimizer step, largest micro-batch
    "gas1": ([4, 4], 4),
    "gas4": ([4, 4], 1),
    "changing": ([1, 4, 2, 3], 1),
}


def _mean_loss_and_grad(model: torch.nn.Module, params: torch.Tensor, samples: list[dict]) -> tuple:
    """Plain PyTorch at ``params``: the mean loss over all ``samples`` as one batch, and its gradient."""
    model = copy.deepcopy(model)
    torch.nn.utils.vector_to_parameters(params.float(), model.parameters())
    batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
    loss = model(**batch)["loss"]
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1).double() for p in model.parameters()])
    return float(loss), grad


def run_models(out: Path, ds: bool) -> dict:
    """SGD with lr 1 for every model x split: each step's update and logged loss against plain PyTorch.

    With lr 1 and no clipping the update of step k is minus the gradient the Trainer applied; the
    reference is the gradient of the mean loss over step k's global batch as one batch (BERT and the
    plain module: mean over samples; GPT-2: over target tokens), taken at the parameters before step k.
    """
    results: dict[str, Any] = {}
    for model_name, (build, make_data) in MODELS.items():
        for split, (sizes, max_micro) in SPLITS.items():
            data = make_data()
            model = build()
            start = copy.deepcopy(model)
            args = _args(
                out / f"{model_name}_{split}",
                max_steps=len(sizes),
                per_device_train_batch_size=sizes[0],
                learning_rate=1.0,
                optim="sgd",
                lr_scheduler_type="constant",
                max_grad_norm=0.0,
                weight_decay=0.0,
                use_cpu=True,
                deepspeed=ds_config() if ds else None,
            )
            trainer = AdaptiveBatchSizeTrainer(
                batch_size_scheduler=lambda step, batch, sizes=sizes: sizes[min(step, len(sizes) - 1)],
                model=model,
                args=args,
                train_dataset=data,
                max_micro_batch_per_gpu=max_micro,
            )
            recorder = ParamRecorder(trainer)
            trainer.add_callback(recorder)
            trainer.train()
            logged = [e["loss"] for e in trainer.state.log_history if "loss" in e]
            before = flat(start)
            steps = []
            for (indices, after, shape), loss in zip(recorder.steps, logged):
                ref_loss, ref_grad = _mean_loss_and_grad(start, before, [data[i] for i in indices])
                applied = before - after  # lr 1: the gradient the optimizer applied
                steps.append(
                    {
                        "plan": shape,
                        "samples": len(indices),
                        "grad_rel_err": float((applied - ref_grad).abs().max() / ref_grad.abs().max()),
                        "grad_ratio": float(applied.norm() / ref_grad.norm()),
                        "logged_loss": loss,
                        "true_loss": ref_loss,
                    }
                )
                before = after
            results[f"{model_name}_{split}"] = {
                "accepts_loss_kwargs": bool(trainer.model_accepts_loss_kwargs),
                "steps": steps,
            }
    return results


RAMP = {
    "schedule": {"type": "linear", "start": 2, "end": 8, "ramp_samples": 16},
    "max_micro_batch_per_gpu": 2,
    "granularity": 2,
}
RAMP_SAMPLES = 16


def run_ramp(out: Path, ds: bool) -> dict:
    """No scheduler: the DeepSpeed config's "adabatch" section ramps the global batch (2 epochs)."""
    trainer = AdaptiveBatchSizeTrainer(
        model=Regressor(),
        args=_args(out, num_train_epochs=2, use_cpu=True, deepspeed=ds_config(RAMP, with_optimizer=True)),
        train_dataset=IndexRegression(RAMP_SAMPLES),
    )
    recorder = StepRecorder(trainer)
    trainer.add_callback(recorder)
    trainer.train()
    return {"steps": recorder.steps, "logs": trainer.state.log_history}


NOISE_SAVE_AT, NOISE_STEPS = 6, 12


class GaussianRegression(_GaussianPairs):
    """The engine tests' regression with a closed-form noise scale, as Trainer inputs (a dict)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = super().__getitem__(i)
        return {"x": x, "labels": y}


class HalfMse(torch.nn.Module):
    """Linear regression without bias from w = 0, loss 0.5 (x . w - y)^2 averaged over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(NOISE_DIM, 1, bias=False)
        torch.nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": 0.5 * ((self.linear(x).squeeze(-1) - labels) ** 2).mean()}


def run_noise(out: Path, ds: bool) -> dict:
    """The gradient_noise schedule from the DeepSpeed config's "adabatch" section.

    ``estimate``: learning rate 0 (w stays 0), batch 64 held (warm-up never ends), 60 measured steps,
    under ZeRO 0 (the reduced .grad read between backward and step) and the backend's stage (DeepSpeed's
    global norm). ``follow``: batch 8, warm-up 3 steps, scale 1: the batch must grow towards B_noise; a
    checkpoint after step 6 resumed by a second trainer must continue the same estimates and batches.
    """
    global ZERO_STAGE
    backend_stage = ZERO_STAGE
    result: dict[str, Any] = {"estimate": {}}
    common = {
        "learning_rate": 0.0,
        "optim": "sgd",
        "lr_scheduler_type": "constant",
        "max_grad_norm": 0.0,
        "per_device_train_batch_size": 8,
        "use_cpu": True,
    }
    for stage in sorted({0, backend_stage}):
        ZERO_STAGE = stage
        trainer = AdaptiveBatchSizeTrainer(
            model=HalfMse(),
            args=_args(
                out / f"estimate_z{stage}",
                max_steps=60,
                deepspeed=ds_config(copy.deepcopy(NOISE_ESTIMATE)),
                **common,
            ),
            train_dataset=GaussianRegression(),
        )
        trainer.train()
        bs = trainer.batch_state
        result["estimate"][f"z{stage}"] = {
            "noise_scale": bs.noise.noise_scale,
            "measurements": bs.noise.count,
            "plan": bs.plan.describe(),
            "logged": [e["noise_scale"] for e in trainer.state.log_history if "noise_scale" in e],
        }
    ZERO_STAGE = backend_stage
    section = {
        "schedule": {
            "type": "gradient_noise",
            "start": 8,
            "scale": 1.0,
            "warmup_steps": 3,
            "hysteresis": 0.0,
            "ema_beta": 0.5,
            # 12 steps: the batch must follow the estimate at once (step 3), so neither the
            # confidence test nor the change cap applies.
            "max_relative_error": None,
            "max_change_factor": None,
        },
        "max_micro_batch_per_gpu": 4,
        "granularity": 4,
    }
    runs = []
    for name, resume in (("first", None), ("second", out / "follow_first" / f"checkpoint-{NOISE_SAVE_AT}")):
        extra = {"save_strategy": "steps", "save_steps": NOISE_SAVE_AT} if resume is None else {}
        trainer = AdaptiveBatchSizeTrainer(
            model=HalfMse(),
            args=_args(
                out / f"follow_{name}",
                max_steps=NOISE_STEPS,
                deepspeed=ds_config(section),
                **{**common, "per_device_train_batch_size": 4},
                **extra,
            ),
            train_dataset=GaussianRegression(),
        )
        recorder = StepRecorder(trainer)
        trainer.add_callback(recorder)
        trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
        runs.append(
            {
                "plans": [s["plan"][0] for s in recorder.steps],
                "noise": {
                    e["step"]: e["noise_scale"] for e in trainer.state.log_history if "noise_scale" in e
                },
            }
        )
    result["follow"] = runs
    result["goodput"] = _run_goodput(out, common)
    saved = json.loads(
        (out / "follow_first" / f"checkpoint-{NOISE_SAVE_AT}" / "adabatch_state.json").read_text()
    )
    result["saved_noise"] = saved["noise"]
    return result


GOODPUT_STEPS = 14


def _run_goodput(out: Path, common: dict) -> dict:
    """The goodput schedule from the section, with a simulated flat step time (a host-bound step: a
    larger batch costs nothing more): the batch must climb to max_global_batch, explaining every move."""
    from ds_adabatch.runtime.core.step_times import SIMULATED_STEP_TIME_ENV

    section = {
        "schedule": {
            "type": "goodput",
            "start": 8,
            "warmup_steps": 3,
            "decide_every": 2,
            "ema_beta": 0.5,
            "max_relative_error": None,
        },
        "max_micro_batch_per_gpu": 4,
        "max_global_batch": 32,
        "granularity": 4,
        # AdaScale's gain as the LR multiplier, set from the noise estimate before every step.
        "lr_scaling": {"rule": "adascale"},
        "log": {"every_steps": 1, "jsonl": str(out / "goodput.jsonl")},
    }
    os.environ[SIMULATED_STEP_TIME_ENV] = "fixed=0.05"
    try:
        trainer = AdaptiveBatchSizeTrainer(
            model=HalfMse(),
            args=_args(
                out / "goodput",
                max_steps=GOODPUT_STEPS,
                deepspeed=ds_config(section),
                # An LR to couple (the scenario's other runs hold the model still at 0).
                **{**common, "per_device_train_batch_size": 4, "learning_rate": 0.01},
            ),
            train_dataset=GaussianRegression(),
        )
        recorder = StepRecorder(trainer)
        trainer.add_callback(recorder)
        coupling: list = []  # per step: the estimate the coupling read, its multiplier, the applied LR
        trainer.add_callback(CouplingRecorder(trainer, coupling))
        trainer.train()
    finally:
        del os.environ[SIMULATED_STEP_TIME_ENV]
    schedule = trainer.batch_state.controller.schedule
    fit = schedule.throughput.fit(trainer.batch_state.world_size)
    records = []
    if trainer.batch_state.rank == 0:  # rank 0 writes the JSONL
        with open(out / "goodput.jsonl") as f:
            records = [json.loads(line) for line in f]
    return {
        "records": records,
        "plans": [s["plan"][0] for s in recorder.steps],
        "moves": schedule.moves,
        "reason": schedule.last_reason,
        "fit_fixed": None if fit is None else fit.fixed,
        "coupling": coupling,
        "reference": trainer._lr_coupling.reference_batch,
    }


class CouplingRecorder(TrainerCallback):
    """Per optimizer step: the noise estimate the LR coupling last read, its multiplier, and the LR the
    optimizer then holds over the one the scheduler set (the multiplier, where it is applied)."""

    def __init__(self, trainer: AdaptiveBatchSizeTrainer, into: list) -> None:
        self.trainer, self.into = trainer, into

    def on_step_end(self, args, state, control, **kwargs) -> None:
        coupled = self.trainer._lr_coupling
        scheduled = coupled.scheduler.get_last_lr()[0]  # 0 at a warm-up's first step
        applied = coupled.get_lr()[0] / scheduled if scheduled > 0 else None
        self.into.append([coupled.noise_scale, coupled.multiplier, applied])


# -- token budgets ----------------------------------------------------------------------------------
TOKEN_VOCAB = 48
"""Token ids 1..47 occur in the data; 0 is the tokenizer's pad."""
TOKEN_SAMPLES = 36
TOKEN_BUDGET = 40
TOKEN_SAVE_AT = 4
TOKEN_LR = 0.1
TOKEN_OOM_AT = 30
"""Tokens per forward pass above which rank 1 runs out of memory in the ``tokens`` scenario's OOM run."""
TOKEN_SECTION = {
    "micro_batch_tokens": TOKEN_BUDGET,
    "padding": "pad_to_longest",
    # Token targets need not divide by the world size; the stream then is the same on any number of ranks.
    "allow_uneven": True,
    "schedule": {"type": "linear", "unit": "tokens", "start": 60, "end": 140, "ramp_samples": 36},
    "bucket_window": 12,
    "lr_scaling": {"rule": "linear"},
}


def token_lengths_of(n: int = TOKEN_SAMPLES) -> list[int]:
    """The lengths of :class:`VariableLengthText`'s samples (3..20 tokens)."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, 21, (n,), generator=g).tolist()


class VariableLengthText(torch.utils.data.Dataset):
    """Token sequences of 3..20 tokens as lists of ids (what a tokenizer's map gives a Trainer).

    ``with_length`` adds each sample's ``"length"`` key (as a precomputed length column would).
    """

    def __init__(self, n: int = TOKEN_SAMPLES, *, with_length: bool = False) -> None:
        g = torch.Generator().manual_seed(8)
        self.lengths = token_lengths_of(n)
        self.ids = [torch.randint(1, TOKEN_VOCAB, (k,), generator=g).tolist() for k in self.lengths]
        self.with_length = with_length

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample: dict[str, Any] = {"input_ids": self.ids[i]}
        if self.with_length:
            sample["length"] = self.lengths[i]
        return sample


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built in code (nothing downloaded): tokens ``t1``..``t47``, pad id 0."""
    from tokenizers import Tokenizer, models

    vocab = {"[PAD]": 0, **{f"t{i}": i for i in range(1, TOKEN_VOCAB)}, "[UNK]": TOKEN_VOCAB}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")


def lm_collator() -> DataCollatorForLanguageModeling:
    """Pads to the longest sample of the batch (``"pad_to_longest"``), labels -100 on the padding."""
    return DataCollatorForLanguageModeling(tiny_tokenizer(), mlm=False)


def token_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=TOKEN_VOCAB + 1,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)


class TokenStepRecorder(TrainerCallback):
    """Per optimizer step: this rank's passes, the step's samples and target, the tokens of every
    forward pass (``input_ids.numel()``, padding included, from a hook on ``model``) and the parameters."""

    def __init__(self, trainer: AdaptiveBatchSizeTrainer, model: torch.nn.Module) -> None:
        self.trainer = trainer
        self.steps: list[dict[str, Any]] = []
        self.params: list[torch.Tensor] = []
        self._numels: list[int] = []
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        self._numels.append(int(ids.numel()))

    def on_step_end(self, args, state, control, **kwargs) -> None:
        bs = self.trainer.batch_state
        step = bs.last_step
        token_step = step.global_batch
        self.steps.append(
            {
                "step": state.global_step,
                "indices": [list(m.indices) for m in step.micro_batches],
                "sizes": [m.num_samples for m in step.micro_batches],
                "global": [int(i) for i in token_step.indices],
                "sample_epoch": token_step.epoch,
                "target": token_step.target_tokens,
                "tokens": token_step.tokens,
                "numels": self._numels,
                "plan": [
                    step.plan.global_batch_size,
                    step.plan.micro_batch_per_gpu,
                    step.plan.gradient_accumulation_steps,
                ],
                "lr": self.trainer.optimizer.param_groups[0]["lr"],
                "epoch": state.epoch,
            }
        )
        self.params.append(flat(self.trainer.model))
        self._numels = []


def reference_steps(
    start: torch.nn.Module, steps: list[dict], samples: Callable[[int], dict], collate: Any, lrs: list[float]
) -> list[torch.Tensor]:
    """Plain PyTorch: per step one padded batch of exactly the step's samples, the model's own mean loss
    over it (GPT-2: over its target tokens; BERT: over its samples), an SGD step at that step's LR;
    the parameters after each step."""
    model = copy.deepcopy(start)
    model.train()
    after = []
    for s, lr in zip(steps, lrs):
        model.zero_grad()
        model(**collate([samples(i) for i in s["global"]])).loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        after.append(flat(model))
    return after


def _errors(start: torch.nn.Module, got: list[torch.Tensor], want: list[torch.Tensor]) -> list[dict]:
    before = flat(start)
    return [
        {
            "max_abs": float((g - w).abs().max()),
            "relative": float((g - w).norm() / (w - before).norm()),
            "update": float((w - before).abs().max()),
        }
        for g, w in zip(got, want)
    ]


class LabelledText(VariableLengthText):
    """:class:`VariableLengthText` with a class label per sample, for a sequence classifier."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i][0] % 2}


def token_bert(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=TOKEN_VOCAB + 1,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config)


SAMPLE_STEPS_SECTION = {
    # A schedule in samples cut into passes of at most 48 padded tokens and 3 samples.
    "micro_batch_tokens": 48,
    "max_micro_batch_per_gpu": 3,
    "schedule": {"type": "constant", "value": 10},
    "loss_normalization": "sample",
}


GOODPUT_TOKENS_SECTION = {
    # The goodput schedule over sample-count steps cut into passes of at most 48 padded tokens, the
    # default warm-up (a move on step cost alone); the step time simulated flat (run_tokens).
    "micro_batch_tokens": 48,
    "schedule": {"type": "goodput", "start": 4, "decide_every": 2, "max_relative_error": None},
    "max_global_batch": 16,
    "loss_normalization": "sample",
}


def run_tokens(out: Path, ds: bool) -> dict:
    """Token-budget steps for 2 epochs with a checkpoint after step 4 and a resumed second run; then
    one epoch of 10-sample steps cut by a token budget (BERT, mean over samples); then two epochs of
    the goodput schedule over such steps, the step time simulated flat."""
    if not ds:
        raise SystemExit("the tokens scenario needs DeepSpeed: micro_batch_tokens is set in its config")
    common = {
        "num_train_epochs": 2,
        "per_device_train_batch_size": 1,
        "learning_rate": TOKEN_LR,
        "optim": "sgd",
        "lr_scheduler_type": "constant",
        "max_grad_norm": 0.0,
        "weight_decay": 0.0,
        "seed": 5,
        "use_cpu": True,
        "deepspeed": ds_config(TOKEN_SECTION),
    }

    def train(name, model, data, collate, resume=None, **extra):
        trainer = AdaptiveBatchSizeTrainer(
            model=model,
            args=_args(out / name, **{**common, **extra}),
            train_dataset=data,
            data_collator=collate,
        )
        recorder = TokenStepRecorder(trainer, model)
        trainer.add_callback(recorder)
        trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
        return trainer, recorder

    start = token_gpt2()
    data = VariableLengthText(with_length=True)
    first, rec1 = train(
        "first", copy.deepcopy(start), data, lm_collator(), save_strategy="steps", save_steps=TOKEN_SAVE_AT
    )
    # Other initial weights: the checkpoint must restore them.
    _, rec2 = train(
        "second", token_gpt2(seed=9), data, lm_collator(), out / "first" / f"checkpoint-{TOKEN_SAVE_AT}"
    )
    start_target = TOKEN_SECTION["schedule"]["start"]
    reference = reference_steps(
        start,
        rec1.steps,
        lambda i: {"input_ids": data[i]["input_ids"]},
        lm_collator(),
        [TOKEN_LR * s["target"] / start_target for s in rec1.steps],
    )

    # The same run where rank 1 runs out of memory in any pass over TOKEN_OOM_AT tokens: each such step
    # is re-cut with a lower token budget and re-run, with the same samples and the same update.
    limit = simulated_memory_limit(ranks=[1], max_tokens_per_forward=TOKEN_OOM_AT)
    limit.install()
    try:
        faulty, rec4 = train("oom", copy.deepcopy(start), data, lm_collator())
    finally:
        limit.remove()

    bert, labelled = token_bert(), LabelledText()
    pad = DataCollatorWithPadding(tiny_tokenizer())
    _, rec3 = train(
        "sample_steps",
        copy.deepcopy(bert),
        labelled,
        pad,
        num_train_epochs=1,
        learning_rate=0.5,
        deepspeed=ds_config(SAMPLE_STEPS_SECTION),
    )
    sample_reference = reference_steps(bert, rec3.steps, labelled.__getitem__, pad, [0.5] * len(rec3.steps))
    from ds_adabatch.runtime.core.step_times import SIMULATED_STEP_TIME_ENV

    os.environ[SIMULATED_STEP_TIME_ENV] = "fixed=0.05"
    try:
        climbing, rec5 = train(
            "goodput",
            copy.deepcopy(bert),
            labelled,
            pad,
            num_train_epochs=2,
            learning_rate=0.5,
            deepspeed=ds_config(GOODPUT_TOKENS_SECTION),
        )
    finally:
        del os.environ[SIMULATED_STEP_TIME_ENV]
    goodput_reference = reference_steps(bert, rec5.steps, labelled.__getitem__, pad, [0.5] * len(rec5.steps))
    schedule = climbing.batch_state.controller.schedule
    return {
        "first": rec1.steps,
        "second": rec2.steps,
        "reference_errors": _errors(start, rec1.params, reference),
        "resume_param_diff": float((rec1.params[-1] - rec2.params[-1]).abs().max()),
        "logs": [e for e in first.state.log_history if "loss" in e],
        "final": {
            "epoch": first.state.epoch,
            "global_step": first.state.global_step,
            "max_steps": first.state.max_steps,
            "tokens": first.batch_state.tokens,
            "samples": first.batch_state.samples_consumed,
        },
        "oom": {
            "steps": rec4.steps,
            "reference_errors": _errors(start, rec4.params, reference),
            "recovered": faulty._recovery.ooms if faulty._recovery is not None else 0,
            "learned_budget": faulty.batch_state.memory.limit,
        },
        "sample_steps": rec3.steps,
        "sample_reference_errors": _errors(bert, rec3.params, sample_reference),
        "goodput": {
            "steps": rec5.steps,
            "reference_errors": _errors(bert, rec5.params, goodput_reference),
            "moves": schedule.moves,
            "shapes": [[m, g] for m, g, _, _ in schedule.throughput.measured(2)],
        },
    }


WORLD_BATCH, WORLD_STEPS, WORLD_SAVE = 4, 6, 3


def run_world(out: Path, ds: bool) -> dict:
    """The ``world`` scenario (module docstring)."""
    global ZERO_STAGE
    if not ds:
        raise SystemExit("the world scenario needs DeepSpeed: its batch comes from the config's section")
    resumes = json.loads(os.environ.get("HF_RESUME_FROM", "null")) or {str(ZERO_STAGE): None}
    result: dict[str, Any] = {}
    for stage, checkpoint in resumes.items():
        ZERO_STAGE = int(stage)
        section = {"schedule": {"type": "constant", "value": WORLD_BATCH}, "max_micro_batch_per_gpu": 4}
        # The resumed run saves too: at step 6 into a folder the test filled with the 2-rank run's.
        saving = {"save_strategy": "steps", "save_steps": WORLD_SAVE}
        trainer = AdaptiveBatchSizeTrainer(
            model=Regressor(seed=5 if checkpoint else 0),
            args=_args(
                out / f"zero{stage}",
                per_device_train_batch_size=4,
                max_steps=WORLD_STEPS,
                learning_rate=0.05,
                seed=11,
                use_cpu=True,
                deepspeed=ds_config(section, with_optimizer=True),
                **saving,
            ),
            train_dataset=IndexRegression(),
        )
        recorder = ParamRecorder(trainer)
        trainer.add_callback(recorder)
        trainer.train(resume_from_checkpoint=checkpoint)
        first = WORLD_STEPS - len(recorder.steps) + 1
        result[stage] = {
            "world_size": trainer.args.world_size,
            "params": {first + i: params.tolist() for i, (_, params, _) in enumerate(recorder.steps)},
            "checkpoint": str(out / f"zero{stage}" / f"checkpoint-{WORLD_SAVE}"),
            "plans": [e.get("gradient_accumulation_steps") for e in trainer.state.log_history if "loss" in e],
        }
    return result


SCENARIOS = {
    "seed": run_seed,
    "exact": run_exact,
    "models": run_models,
    "ramp": run_ramp,
    "noise": run_noise,
    "tokens": run_tokens,
    "world": run_world,
}


def main(argv: list[str]) -> None:
    global ZERO_STAGE
    out, backend, *names = argv
    if backend not in ("ds", "zero3", "ddp"):
        raise SystemExit(f"backend must be ds (ZeRO-2), zero3 or ddp, not {backend!r}")
    ZERO_STAGE = 3 if backend == "zero3" else 2
    out_dir = Path(out)
    for name in names:
        result = SCENARIOS[name](out_dir / f"{name}_{backend}", backend != "ddp")
        rank = int(os.environ.get("RANK", "0"))
        (out_dir / f"{name}_{backend}_rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
    ds_adabatch.finish()
