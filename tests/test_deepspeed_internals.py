"""The door to DeepSpeed's internals (``ds_adabatch/runtime/deepspeed_internals.py``) holds its contract.

- every private name it lists exists on a real DeepSpeed engine of each ZeRO stage (one process builds
  ZeRO 0, 1, 2 and 3 engines): a DeepSpeed release that renames one fails here, naming it;
- no module of the package outside the door mentions a listed name;
- a missing name raises :class:`ContractError` naming the attribute, instead of a silent no-op.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from _util import free_port

from ds_adabatch.runtime import deepspeed_internals as internals

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ds_adabatch"

ENGINES = """
import json, sys, torch, deepspeed
from ds_adabatch.runtime import deepspeed_internals as internals

deepspeed.init_distributed(dist_backend="gloo")
found = {}
for stage in (0, 1, 2, 3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = {
        "train_batch_size": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(4, 8)).pow(2).mean()  # one step: the lazily made state exists
    engine.backward(loss)
    engine.step()
    found[stage] = {
        "problems": internals.contract_problems(engine),
        "gates": [name for _, name, _ in internals.gradient_collective_gates(engine, plain_data_parallel=False)],
        "raw_config_stage": (internals.raw_config(engine) or {}).get("zero_optimization", {}).get("stage"),
    }
    engine.destroy()
print("RESULT " + json.dumps(found))

# ZeRO 3 partitions, and the model back to plain tensors after the engine (no collective).
def attrs(model):
    return {
        "modules": {n: sorted(vars(m)) for n, m in model.named_modules()},
        "params": {n: sorted(vars(p)) for n, p in model.named_parameters()},
    }

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
before = attrs(model)
config = {
    "train_batch_size": 4,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "steps_per_print": 10**6,
}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
x = torch.randn(4, 8)
engine.backward(engine(x).pow(2).mean())
engine.step()
layout = internals.zero3_partitions(engine.optimizer)
placed = {id(p): (offset, size) for _, rows in layout for p, offset, size in rows}
params = dict(model.named_parameters())
covered = sorted(placed) == sorted(id(p) for p in params.values()) and all(
    sum(size for _, _, size in rows) == flat.numel() for flat, rows in layout
)
# World 1: a parameter's partition is all of it; the flat fp32 copy is the parameter's value.
masters = {n: layout[0][0].narrow(0, placed[id(p)][0], p.ds_numel).view(p.ds_shape).clone() for n, p in params.items()}
with deepspeed.zero.GatheredParameters(list(params.values())):
    whole = {n: p.detach().clone() for n, p in params.items()}
    out = model(x).detach()
engine.module_forward_pre_hook.remove()
engine.module_forward_post_hook.remove()
engine.destroy()
internals.unpartition_zero3_model(model, masters)
after = attrs(model)
hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())
plain = {n: p.detach().clone() for n, p in model.named_parameters()}
zero3 = {
    "layout_covers_every_parameter": covered,
    "masters_equal_gathered": all(masters[n].equal(whole[n]) for n in whole),
    "attributes_as_before": after == before,
    "attributes_diff": [k for k in before["params"] if before["params"][k] != after["params"][k]][:3],
    "hooks_left": hooks,
    "plain_values": all(plain[n].equal(whole[n]) for n in whole) and all(type(m._parameters) is dict for m in model.modules()),
    "plain_forward": model(x).detach().equal(out),
}
again, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
with deepspeed.zero.GatheredParameters(list(model.parameters())):
    zero3["repartitioned_forward"] = model(x).detach().equal(out)
again.backward(again(x).pow(2).mean())
again.step()
zero3["problems_again"] = internals.contract_problems(again)
from ds_adabatch.runtime.live.snapshot import coverage_problem
zero3["covered"] = coverage_problem(again)
frozen = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
frozen[0].weight.requires_grad_(False)
engine, *_ = deepspeed.initialize(model=frozen, model_parameters=frozen.parameters(), config=config)
zero3["frozen"] = coverage_problem(engine)
print("ZERO3 " + json.dumps(zero3))
"""


@pytest.mark.multirank
def test_every_listed_name_exists_on_real_engines_of_each_stage(tmp_path):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    proc = subprocess.run(
        [sys.executable, "-c", ENGINES], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, (proc.stdout + proc.stderr)[-4000:]
    found = {int(k): v for k, v in json.loads(line[len("RESULT ") :]).items()}
    for stage, got in found.items():
        assert got["problems"] == [], (
            f"ZeRO {stage}: DeepSpeed lacks {got['problems']} (see deepspeed_internals)"
        )
        assert got["raw_config_stage"] == stage
    assert found[0]["gates"] == ["allreduce_gradients"]
    assert found[1]["gates"] == found[2]["gates"] == ["reduce_ipg_grads"]
    assert found[3]["gates"] == [
        "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads",
        "_PartitionedParameterCoordinator__all_gather_params",
    ]
    # ZeRO 3: the partitions' layout, and a model partitioned by an engine returned to plain tensors
    # (what a live recovery does before it rebuilds): nothing of ZeRO 3 left on it, the same values and
    # forward, and a new engine partitions it again.
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ZERO3 ")), None)
    assert line, (proc.stdout + proc.stderr)[-4000:]
    zero3 = json.loads(line[len("ZERO3 ") :])
    assert zero3["layout_covers_every_parameter"] and zero3["masters_equal_gathered"], zero3
    assert zero3["attributes_as_before"], f"left on the model by ZeRO 3: {zero3['attributes_diff']}"
    assert zero3["hooks_left"] == 0 and zero3["plain_values"] and zero3["plain_forward"], zero3
    assert zero3["repartitioned_forward"] and zero3["problems_again"] == [], zero3
    # Live elasticity covers such an engine, not one with a parameter the optimizer does not hold.
    assert zero3["covered"] is None, zero3
    assert zero3["frozen"].startswith("ZeRO stage 3 with parameters the optimizer does not hold"), zero3


def _mentions(path: Path) -> list[tuple[int, str]]:
    """The listed private names a module mentions: as an attribute, or as a string (getattr, hasattr)."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "value", None)
        if isinstance(name, str) and name in internals.PRIVATE_NAMES:
            hits.append((node.lineno, name))
    return hits


def test_no_module_outside_the_door_touches_a_listed_name():
    door = PACKAGE / "runtime" / "deepspeed_internals.py"
    outside = {
        str(path.relative_to(ROOT)): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != door and (hits := _mentions(path))
    }
    assert outside == {}, f"DeepSpeed's private names outside runtime/deepspeed_internals.py: {outside}"
    assert _mentions(door), "the check must see the door's own names"


def test_a_missing_name_is_an_error_that_names_it():
    renamed = SimpleNamespace(cpu_offload=False)  # a ZeRO 1/2 optimizer without _wait_for_offload_copies
    with pytest.raises(internals.ContractError, match="'_wait_for_offload_copies'"):
        internals.discard_zero12_accumulation(renamed)
    with pytest.raises(internals.ContractError, match="'_hp_optimizer_states_linked'"):
        internals.mark_hp_states_linked(SimpleNamespace())
