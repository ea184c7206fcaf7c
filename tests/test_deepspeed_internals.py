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
