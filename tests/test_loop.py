"""DeepSpeed's own scripts, run as their users run them: the getting-started loop and the pipeline example.

Every launch uses the ``deepspeed`` launcher on CPU ranks (gloo), as DeepSpeed's tutorials do:

* ``tests/loop_worker.py`` (2 ranks, then 1): the forward / backward / step loop over the loader
  ``initialize`` returns against ``train_batch`` (ZeRO 0, 2, 3, the tutorial's Adam config) and against a
  plain-PyTorch big-batch reference (torch's Adam, growing, uneven and GAS-changing plans), with a checkpoint
  saved inside an optimizer step and resumed on 1 rank.
* ``tests/ds_examples/cifar10_deepspeed.py`` — the tutorial script itself, ZeRO 2, two epochs.
* ``tests/ds_examples/pipeline_train.py`` — DeepSpeed's pipeline example: ``--deepspeed_config`` read
  through ``args``, a ``torch.nn.CrossEntropyLoss()`` module as the pipeline's loss, 2 stages, ZeRO 1
  and 0 (under ZeRO 0 the module is given to ``initialize(loss_fn=...)``); its data-parallel branch
  (``-p 0``: DeepSpeed's ``RepeatingLoader`` over the returned loader) under ZeRO 2.

Each launch is its own, as above; the module's fixture runs them in two lanes side by side on the two
cores (one launch's single-process phases, the launchers' and the ranks' start-up, overlap the other's
training) and starts only the launches the selected tests read. Each test fails with its own launch's
error. The focused suite on every torch release (``-m matrix``, scripts/test_torch_matrix.sh) runs the
loop's launches in one lane and the tutorial and the pipeline example (ZeRO 1) in the other, where they
fill the core the loop's 1-rank resume leaves free; the pipeline example's other launches run on the
whole suite's torch only (docs/versions.md).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest
from _util import failure_excerpt, free_port, launches_for, outcome, run_killing_group, side_by_side

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

HERE = Path(__file__).parent
N_LOOP = 96  # loop_worker.N


def deepspeed_launch(script: Path, *args: str, gpus: int, out: Path, timeout: float = 600) -> str:
    """``deepspeed --num_gpus N script args`` on CPU ranks; fails the test with the log unless it exits 0."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["ADABATCH_TEST_OUT"] = str(out)
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(gpus)]
    cmd += ["--master_port", str(free_port()), str(script), *args]
    proc = run_killing_group(cmd, cwd=out, env=env, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(
            f"{script.name} {' '.join(args)} failed (exit {proc.returncode}):\n{failure_excerpt(proc)}"
        )
    return proc.stdout + proc.stderr


def _read(out: Path, name: str) -> dict:
    path = out / f"{name}.json"
    assert path.exists(), f"the launch wrote no {path.name}"
    return json.loads(path.read_text())


def _exactly_once(ledger: list[list[int]], n: int, epochs: int = 1) -> None:
    counts = Counter(i for step in ledger for i in step)
    wrong = {i: c for i, c in counts.items() if c != epochs}
    assert set(counts) == set(range(n)) and not wrong, (
        f"every sample must be trained exactly {epochs} time(s): missing "
        f"{sorted(set(range(n)) - set(counts))[:10]}, wrong counts {dict(list(wrong.items())[:10])}"
    )


# --- The launches -------------------------------------------------------------------------------------
EXAMPLES = HERE / "ds_examples"
PIPE_SECTION = {
    "schedule": {"type": "linear", "start": 8, "end": 32, "ramp_samples": 64},
    "max_micro_batch_per_gpu": 8,
    "granularity": 8,
}
# pipeline_train.py's launches: ZeRO stage, arguments after --deepspeed_config.
PIPE_RUNS = {
    "pipe": (1, ["-p", "2", "--steps", "6"]),
    "pipe_z0": (0, ["-p", "2", "--steps", "6", "--loss-at-initialize"]),
    "base": (2, ["-p", "0", "--steps", "6"]),
}
# Two lanes, side by side, each one launch after the other: "loop" is loop_worker.py's exact phase on 2
# ranks, then its resume phase on 1 (which reads the first's checkpoint). The focused suite runs "loop"
# beside "cifar" and "pipe"; the whole suite adds "pipe_z0" to the first lane and "base" to the second.
LANES = (("loop", "pipe_z0"), ("cifar", "pipe", "base"))
RUNS_OF = {  # the launches each test reads (by name, or by name and parameters)
    "test_the_tutorial_loop_equals_train_batch": {"loop"},
    "test_the_loop_equals_the_big_batch_reference": {"loop"},
    "test_the_loop_under_caller_owned_accumulation_equals_the_hand_set_boundary": {"loop"},
    "test_a_checkpoint_inside_a_step_resumes_that_step_on_another_world_size": {"loop"},
    "test_the_pipeline_example_with_a_loss_module_trains_exactly[pipe]": {"pipe"},
    "test_the_pipeline_example_with_a_loss_module_trains_exactly[pipe_z0]": {"pipe_z0"},
    "test_the_examples_data_parallel_branch_with_repeating_loader": {"base"},
    "test_the_getting_started_tutorial_ramps_and_trains_each_sample_once_per_epoch": {"cifar"},
}


def _example_config(stage: int) -> dict:
    # SGD so that a plain-PyTorch reference can follow; the rest as in the example's ds_config.json.
    return {
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.5}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
        "adabatch": PIPE_SECTION,
    }


def _launch(name: str, out: Path) -> Path:
    """The launch (for "loop", the two) ``name``, writing into ``out``; fails unless it exits 0."""
    if name == "loop":
        for phase, gpus in (("exact", 2), ("resume", 1)):
            deepspeed_launch(HERE / "loop_worker.py", "--phase", phase, "--out", str(out), gpus=gpus, out=out)
        return out
    if name == "cifar":
        script, argv = EXAMPLES / "cifar10_deepspeed.py", ["--stage", "2", "--epochs", "2"]
    else:
        stage, argv = PIPE_RUNS[name]
        (out / "ds_config.json").write_text(json.dumps(_example_config(stage)))
        script, argv = EXAMPLES / "pipeline_train.py", ["--deepspeed_config", "ds_config.json", *argv]
    (out / "log.txt").write_text(deepspeed_launch(script, *argv, gpus=2, out=out))
    return out


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory) -> dict:
    """The launches the selected tests read, side by side: name -> the folder it wrote into (or its error)."""
    wanted = launches_for(request, __name__, RUNS_OF)
    outs = {name: tmp_path_factory.mktemp(name) for lane in LANES for name in lane if name in wanted}
    lanes = [[(n, functools.partial(_launch, n, outs[n])) for n in lane if n in outs] for lane in LANES]
    return side_by_side(*lanes)


@pytest.fixture
def loop_runs(launches) -> Path:
    return outcome(launches, "loop")


@pytest.mark.matrix
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_the_tutorial_loop_equals_train_batch(loop_runs, stage):
    r = _read(loop_runs, f"tutorial_z{stage}")
    assert r["plans"] == r["train_batch_plans"] and len(r["plans"]) >= 3, (
        f"ZeRO {stage}: the loop and train_batch must follow the same ramp: {r['plans']} vs {r['train_batch_plans']}"
    )
    assert r["ledger"] == r["train_batch_ledger"], f"ZeRO {stage}: the loop trained other samples per step"
    _exactly_once(r["ledger"], N_LOOP)
    assert r["rel_err"] <= 1e-6, (
        f"ZeRO {stage}: loop vs train_batch final parameters differ by {r['rel_err']:.2e}"
    )


@pytest.mark.matrix
def test_the_loop_equals_the_big_batch_reference(loop_runs):
    r = _read(loop_runs, "reference")
    gas = {e["new_gradient_accumulation_steps"] for e in r["plans"]}
    uneven = [e for e in r["plans"] if e["new_global_batch"] % 2]
    assert len(gas) >= 2 and uneven, f"the schedule must change GAS and split unevenly: {r['plans']}"
    _exactly_once(r["ledger"], N_LOOP)
    assert r["global_samples"] == N_LOOP
    assert r["rel_err"] <= 1e-6, f"loop vs the big-batch reference: relative error {r['rel_err']:.2e}"
    # One epoch done: the next epoch's micro-batches at the current plan.
    assert r["len_after_epoch"] > 0


@pytest.mark.matrix
def test_the_loop_under_caller_owned_accumulation_equals_the_hand_set_boundary(loop_runs):
    r = _read(loop_runs, "caller_owned")
    assert r["same_ledger"], "caller-owned accumulation trained other samples per step"
    assert r["global_steps"] == r["ds_global_steps"], "one DeepSpeed optimizer step per loop step"
    assert r["rel_err"] <= 1e-6, f"caller-owned vs the hand-set boundary: {r['rel_err']:.2e}"
    # len(loader) at a constant batch is what each epoch hands out, its smaller last step included.
    lengths = _read(loop_runs, "loop_len")["lengths"]
    assert all(before == handed for before, handed in lengths), lengths


@pytest.mark.matrix
def test_a_checkpoint_inside_a_step_resumes_that_step_on_another_world_size(loop_runs):
    import torch

    saved = _read(loop_runs, "saved")
    assert saved["boundary"] is False and saved["gas"] >= 3, f"the save must fall inside a step: {saved}"
    full, resumed = _read(loop_runs, "reference"), _read(loop_runs, "resumed")
    assert resumed["world_size"] == 1
    before = full["ledger"][:3]  # loop_worker.SAVE_AT: inside step 3, whose samples are trained again
    assert resumed["resumed_at_samples"] == sum(len(s) for s in before), "the resume must start at step 3"
    assert resumed["ledger"] == full["ledger"][3:], "the same global batches on 1 rank as on 2"
    _exactly_once(before + resumed["ledger"], N_LOOP)
    got, want = torch.tensor(resumed["params"]), torch.tensor(full["params"])
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= 1e-5, f"resumed on 1 rank vs uninterrupted on 2: relative error {err:.2e}"


# --- DeepSpeed's example scripts, as their users launch them ------------------------------------------
def _reference(ledger: list[list[int]], named: bool) -> dict:
    """The example's network in plain PyTorch, one big batch per global batch, by parameter name."""
    import torch

    sys.path.insert(0, str(EXAMPLES))
    from pipeline_train import SmallAlexNet, SyntheticCIFAR, join_layers

    data = SyntheticCIFAR()
    torch.manual_seed(1138)
    net = SmallAlexNet(num_classes=10)
    layers = join_layers(net)

    def forward(x):
        for layer in layers:
            x = layer(x)
        return x

    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.5)
    for idx in ledger:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(forward(data.images[idx]), data.labels[idx]).backward()
        opt.step()
    if named:
        return {n: p.detach().flatten() for n, p in net.named_parameters()}
    return {
        f"{i}.{n}": p.detach().flatten()
        for i, layer in enumerate(layers)
        if isinstance(layer, torch.nn.Module)
        for n, p in layer.named_parameters()
    }


def _compare(params: dict, want: dict) -> float:
    import torch

    assert set(params) == set(want), f"parameter names differ: {sorted(params)} vs {sorted(want)}"
    return max(
        float((torch.tensor(params[n]) - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12))
        for n in want
    )


@pytest.mark.parametrize("run", [pytest.param("pipe", marks=pytest.mark.matrix), "pipe_z0"])
def test_the_pipeline_example_with_a_loss_module_trains_exactly(launches, run):
    out = outcome(launches, run)
    ranks = [_read(out, f"pipe_rank{r}") for r in (0, 1)]
    assert ranks[0]["ledger"] == ranks[1]["ledger"], "both stages must load the same samples"
    ledger = ranks[0]["ledger"]
    sizes = [len(s) for s in ledger]
    assert sizes[0] == 8 and sizes[-1] == 32 and sizes == sorted(sizes), f"the ramp 8 -> 32: {sizes}"
    flat = [i for s in ledger for i in s]
    assert len(flat) == len(set(flat)) == ranks[0]["global_samples"], "a sample trained twice"
    assert ranks[0]["world_size"] == 1, "2 stages on 2 processes are one data-parallel replica"
    params = {**ranks[0]["params"], **ranks[1]["params"]}
    err = _compare(params, _reference(ledger, named=False))
    assert err <= 1e-5, f"pipeline vs the big-batch reference: relative error {err:.2e}"
    log = (out / "log.txt").read_text()
    assert "global batch 8 -> " in log and "on 1 replica" in log, "plan-change lines of the ramp"


def test_the_examples_data_parallel_branch_with_repeating_loader(launches):
    out = outcome(launches, "base")
    r = _read(out, "pipe_rank0")
    sizes = [len(s) for s in r["ledger"]]
    assert len(sizes) == 6 and sizes[-1] == 32, f"6 optimizer steps ramping to 32: {sizes}"
    flat = [i for s in r["ledger"] for i in s]
    assert len(flat) == len(set(flat)), "a sample trained twice"
    err = _compare(r["params"], _reference(r["ledger"], named=True))
    assert err <= 1e-5, f"RepeatingLoader loop vs the big-batch reference: relative error {err:.2e}"


@pytest.mark.matrix
def test_the_getting_started_tutorial_ramps_and_trains_each_sample_once_per_epoch(launches):
    out = outcome(launches, "cifar")
    r = _read(out, "cifar_2")
    _exactly_once(r["ledger"], 160, epochs=2)
    batches = [e["new_global_batch"] for e in r["history"]]
    assert 48 in batches and len(batches) >= 4, f"the ramp 16 -> 48 happened: {r['history']}"
    assert r["local_rank_arg"] == 0, "args.local_rank is set as DeepSpeed sets it"
    log = (out / "log.txt").read_text()
    assert "[ds_adabatch] step" in log and "Finished Training" in log and "loss:" in log
