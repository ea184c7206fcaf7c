"""A run_clm.py-shaped Trainer script (``tests/hf_clm_script.py``) as a user runs it: 2 ranks, three launches.

* DDP, ``--num_train_epochs 2``, a ``batch_size_scheduler`` function and ``adabatch_config=`` (a section
  without a schedule: the largest micro-batch and a JSONL log), ``--log_level info``;
* DeepSpeed ZeRO-2 with the shipped ``ds_configs/hf_zero2.json`` (a JSONL log added to its section),
  ``--max_steps`` across an epoch boundary, ``--log_level info``;
* DeepSpeed ZeRO-3 with the shipped ``ds_configs/hf_zero3.json``, ``--num_train_epochs 1.5``, the
  default ``use_cpu=False`` and ``--log_level warning``.

Each is checked against what the run itself did (its JSONL records): the training banner's numbers,
the ``[ds_adabatch]`` lines (shown at INFO, quiet at WARNING), ``trainer_state.json``, a checkpoint's
``adabatch_state.json`` and the evaluation at the end.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from _util import torchrun

from ds_adabatch.integrations.hf.versions import legacy_loop, transformers_4

pytestmark = pytest.mark.multirank

pytest.importorskip("transformers")
LEGACY = legacy_loop()
"""transformers 4.57.6 and 5.0-5.2: the one-function loop's banner has no steps-per-epoch line."""
ROUNDS = transformers_4()
"""transformers 4.57 logs the loss rounded to 4 decimals."""
STEPS_PER_EPOCH = "Num update steps per epoch"

HERE = Path(__file__).parent
ROOT = HERE.parent
SAMPLES = 64  # hf_clm_script.py's default --train_blocks
COMMON = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--logging_steps", "1"]
COMMON += ["--save_steps", "4", "--report_to", "none", "--disable_tqdm", "true", "--learning_rate", "1e-3"]


def _template(tmp: Path, name: str, jsonl: Path) -> Path:
    """A shipped template with a JSONL log added to its adabatch section."""
    config = json.loads((ROOT / "ds_configs" / name).read_text())
    config["adabatch"]["log"] = {"jsonl": str(jsonl), "every_steps": 3}
    path = tmp / name
    path.write_text(json.dumps(config))
    return path


def _launch(tmp: Path, name: str, *args: str) -> dict:
    out = tmp / name
    proc = torchrun(
        HERE / "hf_clm_script.py", "--output_dir", str(out), *COMMON, *args, nproc=2, cwd=HERE, timeout=900
    )
    text = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(text)
    if proc.returncode != 0:
        pytest.fail(f"hf_clm_script.py ({name}) failed with exit {proc.returncode}:\n{text[-4000:]}")
    records = [json.loads(line) for line in (tmp / f"{name}.jsonl").read_text().splitlines()]
    return {"out": out, "log": text, "records": records}


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("clm_ddp")
    section = {"max_micro_batch_per_gpu": 4, "log": {"jsonl": str(tmp / "ddp.jsonl"), "every_steps": 3}}
    (tmp / "section.json").write_text(json.dumps(section))
    run = _launch(
        tmp, "ddp", "--adabatch_config", str(tmp / "section.json"), "--grow_every", "2",
        "--num_train_epochs", "2", "--use_cpu", "true", "--log_level", "info",
    )  # fmt: skip
    return {**run, "epochs": 2}


@pytest.fixture(scope="module")
def zero2(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("clm_zero2")
    config = _template(tmp, "hf_zero2.json", tmp / "zero2.jsonl")
    run = _launch(
        tmp,
        "zero2",
        "--deepspeed",
        str(config),
        "--max_steps",
        "10",
        "--use_cpu",
        "true",
        "--log_level",
        "info",
    )
    return {**run, "max_steps": 10}


@pytest.fixture(scope="module")
def zero3(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("clm_zero3")
    config = _template(tmp, "hf_zero3.json", tmp / "zero3.jsonl")
    run = _launch(
        tmp, "zero3", "--deepspeed", str(config), "--num_train_epochs", "1.5", "--log_level", "warning"
    )
    return {**run, "epochs": 1.5}


RUNS = ["ddp", "zero2", "zero3"]


def _run(request, name: str) -> dict:
    return request.getfixturevalue(name)


def _banner(log: str) -> dict[str, str]:
    found = {}
    for key in (
        "Num Epochs",
        STEPS_PER_EPOCH,
        "Total train batch size",
        "Gradient Accumulation steps",
        "Total optimization steps",
    ):
        if key == STEPS_PER_EPOCH and LEGACY:
            # the one-function loop prints no such line; ds_adabatch's own line right below says it.
            match = re.search(r"\[ds_adabatch\] optimizer steps per epoch: (.+)", log)
        else:
            match = re.search(rf"  {re.escape(key)}[^=]* = (.+)", log)
        assert match, f"the training banner has no {key!r} line"
        found[key] = match.group(1).strip()
    return found


def _first_int(text: str) -> int:
    return int(re.match(r"[\d,]+", text).group(0).replace(",", ""))


@pytest.mark.parametrize("name", RUNS)
def test_the_jsonl_has_one_record_per_step_matching_the_trainers_logs(request, name):
    run = _run(request, name)
    records = run["records"]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)), "steps missing or repeated"
    state = json.loads((run["out"] / "trainer_state.json").read_text())
    assert len(records) == state["global_step"], f"{len(records)} records for {state['global_step']} steps"
    logged = {e["step"]: e for e in state["log_history"] if "loss" in e and "train_coverage" in e}
    for r in records:
        entry = logged[r["step"]]
        assert r["loss"] == pytest.approx(entry["loss"], rel=1e-5, abs=5e-5 if ROUNDS else 0), (
            f"step {r['step']}: {r['loss']} vs {entry['loss']}"
        )
        shape = [r["global_batch"], r["micro_batch_per_gpu"], r["gradient_accumulation_steps"]]
        logged_shape = [
            entry["global_batch_size"],
            entry["micro_batch_size"],
            entry["gradient_accumulation_steps"],
        ]
        assert shape == logged_shape, f"step {r['step']}: JSONL {shape}, Trainer log {logged_shape}"
    assert records[-1]["samples"] == sum(r["global_batch"] for r in records)
    assert records[-1]["epoch"] == pytest.approx(state["epoch"])
    assert all(r["tokens"] is not None for r in records), "GPT-2 runs count target tokens"


@pytest.mark.parametrize("name", RUNS)
def test_trainer_state_says_what_happened(request, name):
    run = _run(request, name)
    state = json.loads((run["out"] / "trainer_state.json").read_text())
    steps, final_epoch = len(run["records"]), run["records"][-1]["epoch"]
    assert state["max_steps"] == state["global_step"] == steps, f"max_steps {state['max_steps']}, ran {steps}"
    touched = math.ceil(final_epoch - 1e-9)
    expected_epochs = touched if "max_steps" in run else math.ceil(run["epochs"])
    assert state["num_train_epochs"] == expected_epochs, f"num_train_epochs {state['num_train_epochs']}"
    if "epochs" in run:
        assert final_epoch == pytest.approx(run["epochs"], abs=0.1), f"stopped at epoch {final_epoch}"
    else:
        assert final_epoch > 1.0, "the max_steps run should cross an epoch boundary"
    results = json.loads((run["out"] / "eval_results.json").read_text())
    assert math.isfinite(results["eval_loss"]) and results["epoch"] == pytest.approx(final_epoch)


@pytest.mark.parametrize("name", ["ddp", "zero2"])
def test_the_banner_gives_the_runs_real_numbers(request, name):
    run = _run(request, name)
    banner, records = _banner(run["log"]), run["records"]
    assert _first_int(banner["Total train batch size"]) == records[0]["global_batch"]
    assert _first_int(banner["Gradient Accumulation steps"]) == records[0]["gradient_accumulation_steps"]
    first_epoch = sum(1 for r in records if r["epoch"] <= 1.0 + 1e-9)
    if name == "zero2":  # a linear ramp: replayed exactly from the schedule
        assert _first_int(banner["Num update steps per epoch"]) == first_epoch, banner
        assert _first_int(banner["Num Epochs"]) == math.ceil(records[-1]["epoch"]), banner
        assert _first_int(banner["Total optimization steps"]) == run["max_steps"] == len(records), banner
    else:  # a scheduler function: estimated at the first batch, said to change
        assert "changes with the batch" in banner["Num update steps per epoch"], banner
        assert _first_int(banner["Num Epochs"]) == 2
        at_first = math.ceil(SAMPLES / records[0]["global_batch"])
        assert (
            f"{at_first} at the global batch of {records[0]['global_batch']}"
            in banner["Num update steps per epoch"]
        )


@pytest.mark.parametrize("name", ["ddp", "zero2"])
def test_plan_changes_are_logged_at_info_with_the_real_batches(request, name):
    run = _run(request, name)
    lines = re.findall(r"\[ds_adabatch\] step (\d+): global batch (\d+) -> global (\d+) ", run["log"])
    assert lines, "no [ds_adabatch] plan-change line at --log_level info"
    by_step = {r["step"]: r for r in run["records"]}
    for step, old, new in lines:
        record = by_step[int(step) + 1]  # the record of the step the change applies to
        tail = record["train_coverage"] == 1.0 and record["global_batch"] < int(new)
        assert record["global_batch"] == int(new) or tail, f"line for step {step} -> {new}, ran {record}"
        assert int(old) != int(new)


def test_a_quiet_log_level_keeps_the_info_lines_quiet(zero3):
    log = zero3["log"]
    assert "***** Running training *****" not in log, "transformers' INFO lines showed at --log_level warning"
    assert "[ds_adabatch] step" not in log, "plan-change lines showed at --log_level warning"
    # Warnings still show: the default use_cpu=False on CPU is turned into one data-parallel group.
    assert "continuing with use_cpu=True" in log
    assert len({r["global_batch"] for r in zero3["records"] if r["train_coverage"] < 1.0}) > 1, "no ramp"


def test_micro_batches_of_one_are_warned_about_before_they_run(ddp):
    # adabatch_config= without allow_uneven: an odd per-device batch over 4 per pass runs one sample
    # per pass; the warning names the step and the fix.
    ones = [
        r for r in ddp["records"] if r["micro_batch_per_gpu"] == 1 and r["gradient_accumulation_steps"] > 1
    ]
    assert ones, "the run never hit a micro-batch of 1 (the function should reach 11 per device)"
    for r in ones:
        line = f"global batch {r['global_batch']} runs as micro-batches of 1 sample"
        assert line in ddp["log"] and '"allow_uneven": true' in ddp["log"], f"no warning for step {r['step']}"


@pytest.mark.parametrize("name", RUNS)
def test_a_checkpoint_holds_the_runs_stream_and_schedule(request, name):
    run = _run(request, name)
    records = run["records"]
    state = json.loads((run["out"] / "checkpoint-4" / "adabatch_state.json").read_text())
    assert state["global_step"] == 4
    sampler = state["data"]["sampler"]
    assert sampler["samples_consumed"] == sum(r["global_batch"] for r in records[:4])
    assert state["next"]["global_batch"] == records[4]["global_batch"] or records[4]["train_coverage"] == 1.0
    schedule = state["controller"]["schedule"]
    if name == "ddp":
        assert schedule["function"] == "__main__:grow_per_device_batch", schedule
        assert schedule["current"] * 2 == state["next"]["global_batch"], "the function counts per device"
    else:
        assert state["controller"]["schedule_type"] == "linear"
