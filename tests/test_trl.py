"""``AdaptiveBatchSizeTrainer`` with TRL's trainers, as docs/trainer.md composes them: two launches of 2 ranks.

* ``tests/trl_worker.py``: ``SFTTrainer`` (plain text, packing, completion-only loss) and ``DPOTrainer``
  composed as ``class C(AdaptiveBatchSizeTrainer, SFTTrainer)``, against TRL's own trainer at the same
  constant global batch (the whole dataset, so both train exactly the same samples every step): the
  parameters after two steps agree as closely as TRL's trainer agrees with itself at another split
  of that batch (one micro-batch per rank against two), and a fraction of the distance a wrong
  normalisation gives (the mean of micro-batch means is 0.2 away where these are 0.002). Before
  transformers 5.10 the reference counts the target tokens after the causal shift, as 5.10+ does (the
  older releases' own count is one per sequence too many: ``trl_worker.classes``).
* ``tests/trl_sft_script.py``: TRL's own ``trl/scripts/sft.py`` with the documented swap, under DeepSpeed
  ZeRO-2 with a linear ramp in the config's ``"adabatch"`` section, on a tiny local Llama, character
  tokenizer and JSON-lines dataset: its JSONL says every step's batch and the epoch's samples.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _util import torchrun

pytest.importorskip("trl")

pytestmark = pytest.mark.multirank

HERE = Path(__file__).parent
CASES = ["sft", "packing", "completion_only", "dpo"]


def _launch(tmp: Path, script: str, *args: str, what: str):
    env_offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    saved = {k: os.environ.get(k) for k in env_offline}
    os.environ.update(env_offline)
    try:
        proc = torchrun(HERE / script, *args, nproc=2, cwd=HERE, timeout=900)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    text = proc.stdout + proc.stderr
    (tmp / f"{script}.log").write_text(text)
    if proc.returncode != 0:
        pytest.fail(f"{what} failed with exit {proc.returncode}:\n{text[-5000:]}")
    return text


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("trl_exact")
    _launch(tmp, "trl_worker.py", str(tmp), what="the TRL comparison launch")
    return json.loads((tmp / "results.json").read_text())


@pytest.mark.parametrize("case", CASES)
def test_the_composition_trains_as_trls_own_trainer(compared, case):
    r = compared[case]
    assert r["moved"] > 0.1, f"{case}: the reference run barely trained ({r})"
    bound = max(3 * r["trl_split_rel_diff"], 1e-5)
    assert r["rel_diff"] <= bound, (
        f"{case}: AdaptiveBatchSizeTrainer + TRL ended {r['rel_diff']:.2e} (relative) from TRL's own trainer "
        f"at the same global batch of {r['samples']} samples; TRL's trainer at another split of that batch "
        f"ends {r['trl_split_rel_diff']:.2e} from itself"
    )
    # The first step starts from the same weights: the logged loss is the global batch's mean there.
    # (transformers 4.57 logs it rounded to 4 decimals.)
    assert r["our_losses"][0] == pytest.approx(r["trl_losses"][0], rel=1e-5, abs=5e-5), r
    assert len(r["our_losses"]) == len(r["trl_losses"]) == 2, r


def _tiny_model_and_data(tmp: Path) -> tuple[Path, Path]:
    import random

    from trl_worker import sentence, tiny_llama, tiny_tokenizer

    model_dir, data_dir = tmp / "tiny-llama", tmp / "data"
    tok = tiny_tokenizer(model_dir)
    tiny_llama(len(tok)).save_pretrained(model_dir)
    data_dir.mkdir()
    rng = random.Random(3)
    with open(data_dir / "train.jsonl", "w") as f:
        for _ in range(96):
            f.write(json.dumps({"text": sentence(rng, 2, 12)}) + "\n")
    return model_dir, data_dir


@pytest.fixture(scope="module")
def sft_script(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("trl_sft")
    model_dir, data_dir = _tiny_model_and_data(tmp)
    jsonl = tmp / "steps.jsonl"
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 2},
        "adabatch": {
            "schedule": {"type": "linear", "start": 8, "end": 24, "ramp_samples": 48},
            "max_micro_batch_per_gpu": 4,
            "allow_uneven": True,
            "log": {"jsonl": str(jsonl)},
        },
    }
    (tmp / "ds.json").write_text(json.dumps(ds_config))
    out = tmp / "out"
    log = _launch(
        tmp, "trl_sft_script.py",
        "--model_name_or_path", str(model_dir), "--dataset_name", str(data_dir),
        "--deepspeed", str(tmp / "ds.json"), "--output_dir", str(out), "--use_cpu", "true",
        "--per_device_train_batch_size", "4", "--num_train_epochs", "1", "--learning_rate", "1e-3",
        "--max_length", "64", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
        "--disable_tqdm", "true",
        what="trl/scripts/sft.py with the swap",
    )  # fmt: skip
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    return {"out": out, "log": log, "records": records}


def test_trls_sft_script_ramps_the_batch_over_the_epoch(sft_script):
    records = sft_script["records"]
    batches = [r["global_batch"] for r in records]
    assert batches[0] == 8 and max(batches) > 8, f"the ramp 8 -> 24 did not move the batch: {batches}"
    # A linear ramp only grows; the epoch's last step takes the samples left.
    assert batches[:-1] == sorted(batches[:-1]) and sum(batches) == 96, batches
    assert records[-1]["samples"] == 96, f"one epoch of the 96 samples, got {records[-1]['samples']}"
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert (sft_script["out"] / "model.safetensors").is_file(), "sft.py saves the trained model"
