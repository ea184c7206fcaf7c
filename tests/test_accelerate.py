"""accelerate's own example, ``deepspeed_with_config_support.py``, with ``prepare(accelerator, ...)``.

``tests/accelerate_examples/deepspeed_with_config_support.py`` is the example with the documented change
(docs/accelerate.md), run on CPU ranks with a tiny GPT-2 and local text (``_accelerate_fixtures``):

* under ``accelerate launch`` (one process, ZeRO 3) at a constant batch of 4, against the same script
  without ds_adabatch (``accelerator.prepare``): the same loss for every micro-batch (the linear LR
  decay included) and the same evaluation;
* on two ranks (ZeRO 1, a batch ramping 4 -> 12 in uneven plans, GAS changing, a constant LR): every
  sample of the epoch once, ``sync_gradients`` true exactly on each plan's last micro-batch, and final
  parameters equal to a plain-PyTorch big-batch reference over the same steps (<= 1e-6 relative, fp32);
* ``accelerator.load_state`` of that run's step-6 checkpoint on one process under ZeRO 2 (another world
  size and stage, through the universal checkpoint): the
  rest of the epoch takes the same samples per step and ends at the same parameters;
* DeepSpeed-Chat's step-1 ``main.py`` with the loop swap (``tests/ds_examples/dschat_step1_main.py``,
  docs/engine.md) on two ranks under the ``deepspeed`` launcher (ZeRO 2), against a big-batch reference;
* the refusals (one process, no launcher): the ``deepspeed.initialize`` swap, no DeepSpeed plugin, no
  section, a batch key that disagrees with the plan.

Two ranks run under torchrun with accelerate's DeepSpeed settings in the environment (as ``accelerate
launch`` sets them): accelerate 1.15 cannot run DeepSpeed on two CPU processes itself. Its
``PartialState`` finds no distributed backend on a machine without an accelerator device unless
``--cpu`` is given, and ``--cpu`` turns DeepSpeed off (``ACCELERATE_USE_DEEPSPEED`` is read only
``and not cpu``); so each process sees ``num_processes == 1`` while DeepSpeed's group holds both, and
``accelerator.prepare`` fails DeepSpeed's batch-size check (and ``gather_for_metrics`` gathers one tensor
over a group of two, so the two-rank launch skips the example's evaluation: ``--no_eval``). The engine ds_adabatch builds takes its
world from DeepSpeed, so the run is right on both ranks; accelerate's own view (both ranks "main") only
touches what the example logs and saves.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from _accelerate_fixtures import ds_config, write_inputs
from _util import failure_excerpt, free_port, launches_for, outcome, run_killing_group, side_by_side

HERE = Path(__file__).parent
SCRIPT = HERE / "accelerate_examples" / "deepspeed_with_config_support.py"
RAMP = {
    "schedule": {"type": "linear", "start": 4, "end": 12, "ramp_samples": 60},
    "max_micro_batch_per_gpu": 3,
    "allow_uneven": True,
}
CONSTANT = {
    "schedule": {"type": "constant", "value": 4},
    "max_micro_batch_per_gpu": 4,
    "data": {"shuffle": False},
}
COMMON = [
    "--block_size",
    "16",
    "--seed",
    "0",
    "--num_train_epochs",
    "1",
    "--per_device_train_batch_size",
    "4",
]
COMMON += ["--learning_rate", "1e-4"]  # small steps: Adam does not amplify fp32 rounding past 1e-7


def _env(out: Path, config: str) -> dict[str, str]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(
        ADABATCH_TEST_OUT=str(out), HF_HOME=str(out / "hf"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1"
    )
    # What `accelerate launch --use_deepspeed --deepspeed_config_file ...` puts in the workers' environment.
    env.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=config)
    env.update(ACCELERATE_MIXED_PRECISION="no", ACCELERATE_DYNAMO_BACKEND="NO")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    return env


def _launch(cmd: list[str], out: Path, config: str, what: str) -> str:
    proc = run_killing_group(cmd, cwd=out, env=_env(out, config), timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (exit {proc.returncode}):\n{failure_excerpt(proc)}")
    return proc.stdout + proc.stderr


def accelerate_launch(out: Path, config: str, *args: str, what: str) -> str:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1"]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", "--use_deepspeed"]
    cmd += ["--deepspeed_config_file", config, "--main_process_port", str(free_port()), str(SCRIPT), *args]
    return _launch(cmd, out, config, what)


def torchrun_2(out: Path, config: str, *args: str, what: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(free_port()), str(SCRIPT), *args]
    return _launch(cmd, out, config, what)


DSCHAT = HERE / "ds_examples" / "dschat_step1_main.py"


def deepspeed_launch_2(out: Path, *args: str) -> str:
    """``deepspeed --num_gpus 2 script`` on CPU ranks, as DeepSpeed-Chat's scripts launch."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(ADABATCH_TEST_OUT=str(out))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
    ]
    proc = run_killing_group([*cmd, str(DSCHAT), *args], cwd=out, env=env, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"dschat_step1_main.py failed (exit {proc.returncode}):\n{failure_excerpt(proc)}")
    return proc.stdout + proc.stderr


RUNS_OF = {
    "test_deepspeed_chat_step1_trains_the_plan_exactly": {"dschat"},
    "test_constant_batch_matches_accelerate_without_adabatch": {"const_ours", "const_plain"},
    "test_two_ranks_match_a_big_batch_reference": {"ramp2"},
    "test_load_state_resumes_on_another_world_size": {"ramp2", "resume1"},
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict:
    wanted = launches_for(request, __name__, RUNS_OF)
    root = tmp_path_factory.mktemp("accelerate")
    inputs = write_inputs(root)
    data = [
        "--train_file",
        inputs["text"],
        "--config_name",
        inputs["model"],
        "--tokenizer_name",
        inputs["model"],
    ]

    def folder(name: str) -> Path:
        path = root / name
        path.mkdir()
        return path

    def const(plain: bool):
        out = folder("plain" if plain else "ours")
        config = ds_config(out, "ds", CONSTANT, stage=3)
        extra = ["--without_adabatch"] if plain else []
        accelerate_launch(
            out, config, *data, *COMMON, "--no_shuffle", *extra, "--run_name", "run", what="const"
        )
        return out

    ramp_dir = root / "ramp"

    def ramp():
        out = folder("ramp")
        config = ds_config(out, "ds", RAMP, stage=1)
        args = [*data, *COMMON, "--lr_scheduler_type", "constant", "--checkpointing_steps", "6"]
        args += ["--output_dir", "ckpt", "--run_name", "run", "--no_eval"]  # accelerate cannot gather here
        torchrun_2(out, config, *args, what="two ranks")
        return out

    def resume():
        out = folder("resume")
        # ZeRO 2 on one process, from the two-rank ZeRO 1 checkpoint (converted to the universal form).
        config = ds_config(out, "ds", RAMP, stage=2)
        args = [*data, *COMMON, "--lr_scheduler_type", "constant", "--run_name", "run"]
        args += ["--resume_from_checkpoint", str(ramp_dir / "ckpt" / "step_6")]
        accelerate_launch(out, config, *args, what="resume on one process")
        return out

    def dschat():
        out = folder("dschat")
        deepspeed_launch_2(out, "--zero_stage", "2", "--dtype", "fp32", "--learning_rate", "1e-4")
        return out

    lane_a = [("const_ours", lambda: const(False)), ("const_plain", lambda: const(True)), ("dschat", dschat)]
    lane_b = [("ramp2", ramp), ("resume1", resume)]
    keep = lambda lane: [(n, c) for n, c in lane if n in wanted]  # noqa: E731
    results = side_by_side(keep(lane_a), keep(lane_b))
    results["_root"] = root
    return results


def _record(out: Path) -> dict:
    path = out / "run.json"
    assert path.exists(), f"the launch wrote no {path}"
    return json.loads(path.read_text())


def _relative(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


@pytest.mark.multirank
@pytest.mark.slow
def test_constant_batch_matches_accelerate_without_adabatch(runs):
    ours, plain = _record(outcome(runs, "const_ours")), _record(outcome(runs, "const_plain"))
    assert len(ours["losses"]) == len(plain["losses"]) > 10, "both loops must run the same micro-batches"
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], plain["losses"]))
    assert worst <= 1e-5, f"losses differ from accelerate's own loop by up to {worst:.2e} (relative)"
    assert ours["sync"] == plain["sync"] and all(ours["sync"]), (
        "one micro-batch per optimizer step, as accelerate"
    )
    assert ours["completed_steps"] == plain["completed_steps"]
    assert abs(ours["eval"][0] - plain["eval"][0]) <= 1e-5 * abs(plain["eval"][0])


@pytest.mark.multirank
@pytest.mark.slow
def test_two_ranks_match_a_big_batch_reference(runs):
    import torch

    out = outcome(runs, "ramp2")
    record = _record(out)
    ledger, train_ids = record["ledger"], record["train_ids"]
    seen = sorted(i for step in ledger for i in step)
    assert seen == list(range(len(train_ids))), "every training sample exactly once in the epoch"
    sizes = [len(step) for step in ledger]
    assert sizes[0] == 4 and max(sizes) == 12 and len(set(sizes)) > 3, f"the batch must ramp 4 -> 12: {sizes}"
    # sync_gradients: true once per optimizer step, on its last micro-batch.
    assert sum(record["sync"]) == len(ledger) == record["completed_steps"] and record["sync"][-1]
    assert any(gas > 1 for _, _, gas in record["history"]), "the ramp must change GAS"

    reference = _big_batch_reference(out, ledger, train_ids)
    final = torch.load(out / "run.pt", map_location="cpu")
    rel = _relative(final, reference)
    assert rel <= 1e-6, f"final parameters differ from the big-batch reference by {rel:.2e} (relative)"


@pytest.mark.multirank
@pytest.mark.slow
def test_load_state_resumes_on_another_world_size(runs):
    import torch

    whole, resumed = outcome(runs, "ramp2"), outcome(runs, "resume1")
    first, second = _record(whole), _record(resumed)
    assert second["ledger"] == first["ledger"][6:], "the resumed run must take the same samples per step"
    rel = _relative(torch.load(resumed / "run.pt", map_location="cpu"), torch.load(whole / "run.pt"))
    assert rel <= 1e-6, f"resumed on one process, final parameters differ by {rel:.2e} (relative)"


def _big_batch_reference(out: Path, ledger: list[list[int]], train_ids: list[list[int]]) -> dict:
    """Plain PyTorch: one AdamW step per optimizer step over its whole global batch (the mean loss)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    root = out.parent
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(root / "tiny_gpt2"))
    model.load_state_dict(torch.load(out / "initial.pt"))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    for step in ledger:
        ids = torch.tensor([train_ids[i] for i in step])
        model(input_ids=ids, labels=ids).loss.backward()  # equal lengths: token mean = sample mean
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.multirank
@pytest.mark.slow
def test_deepspeed_chat_step1_trains_the_plan_exactly(runs):
    """DeepSpeed-Chat's step 1 with the loop swap (docs/engine.md): the plan's batches, exactly."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    out = outcome(runs, "dschat")
    record = json.loads((out / "dschat.json").read_text())
    ledger, train_ids = record["ledger"], record["train_ids"]
    assert sorted(i for step in ledger for i in step) == list(range(len(train_ids))), "every sample once"
    assert len({len(step) for step in ledger}) > 2, f"the batch must ramp: {[len(s) for s in ledger]}"
    saved = torch.load(out / "dschat.pt")
    config = GPT2Config(vocab_size=256, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    model.load_state_dict(saved["initial"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
    for step in ledger:
        ids = torch.tensor([train_ids[i] for i in step])
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    rel = _relative(saved["final"], model.state_dict())
    assert rel <= 1e-6, f"final parameters differ from the big-batch reference by {rel:.2e} (relative)"


REFUSALS = """
import os, sys, torch, deepspeed, ds_adabatch
from ds_adabatch.integrations.accelerate import prepare

config = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "adabatch": {"schedule": {"type": "constant", "value": 4}, "max_micro_batch_per_gpu": 2}}
model = torch.nn.Linear(2, 1)

def refused(what, call, error=RuntimeError):
    try:
        call()
    except error as exc:
        print(what, "|", str(exc).replace("\\n", " "), "|", torch.distributed.is_initialized(), flush=True)
    else:
        print(what, "| not refused")

real = deepspeed.initialize
deepspeed.initialize = ds_adabatch.initialize  # the swap users try
refused("SWAP", lambda: deepspeed.initialize(model=model, config=config))
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2)
refused("NODS", lambda: prepare(Accelerator(cpu=True), model, loader))
from accelerate.state import AcceleratorState
AcceleratorState._reset_state(True)
deepspeed.initialize = real
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
plugin = DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 0}})
accelerator = Accelerator(deepspeed_plugin=plugin)
refused("NOSECTION", lambda: prepare(accelerator, model, loader), ds_adabatch.ConfigError)
plugin.deepspeed_config.update(adabatch=config["adabatch"], train_micro_batch_size_per_gpu=3)
refused("NUMBER", lambda: prepare(accelerator, model, loader), ds_adabatch.ConfigError)
deepspeed.initialize = lambda **kw: ds_adabatch.initialize(**kw)  # a wrapper that calls back into it
refused("WRAPPER", lambda: deepspeed.initialize(model=model, config=config))
"""


@pytest.mark.slow
def test_refusals_are_sentences(tmp_path):
    """The swap users try, a wrapper around it, no DeepSpeed plugin, no section, a disagreeing number."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    proc = run_killing_group([sys.executable, "-c", REFUSALS], cwd=tmp_path, env=env, timeout=300)
    lines = {
        line.split(" | ")[0]: line.split(" | ")[1:] for line in proc.stdout.splitlines() if " | " in line
    }
    assert proc.returncode == 0 and len(lines) == 5, failure_excerpt(proc)
    swap, wrapper = lines["SWAP"], lines["WRAPPER"]
    for got in (swap, wrapper):
        assert "ds_adabatch.integrations.accelerate.prepare(accelerator" in got[0], got
        assert "adabatch: is missing" not in got[0], got
    assert swap[1] == "False", "the swap must be refused before any process group starts"
    assert "DeepSpeed plugin" in lines["NODS"][0], lines["NODS"]
    assert 'no "adabatch" section' in lines["NOSECTION"][0], lines["NOSECTION"]
    number = lines["NUMBER"][0]
    assert "train_micro_batch_size_per_gpu" in number and "initial plan" in number, number
