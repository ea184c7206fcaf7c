"""The Trainer's resume on another number of ranks (``ds_adabatch.integrations.hf.resume``), without ranks.

The conversion and the resumed steps themselves run on real ranks in ``tests/test_hf_trainer.py``; here,
what happens around a load: the universal switch bound to the engine it was set on and off again after
a failed load, an engine without an optimizer left alone, the record that lets a later resume reuse the
converted copy.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ds_adabatch.integrations.hf import resume


class _Engine:
    """What the resume reads of a DeepSpeed engine, and the config switch it sets."""

    def __init__(self, *, groups: int | None = 1, stage: int = 2) -> None:
        self._config = SimpleNamespace(load_universal_checkpoint=False)
        self.optimizer = None if groups is None else SimpleNamespace(param_groups=[{}] * groups)
        self._stage = stage

    def zero_optimization_stage(self) -> int:
        return self._stage

    def load_universal_checkpoint(self) -> bool:
        return self._config.load_universal_checkpoint


@pytest.fixture
def checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list]:
    """A Trainer checkpoint folder of 2 ranks under ZeRO 2 (file names only), the conversion recorded."""
    folder = tmp_path / "checkpoint-6"
    tag = folder / "global_step6"
    tag.mkdir(parents=True)
    for rank in (0, 1):
        (tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    (folder / "latest").write_text("global_step6")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 6}))
    (folder / "adabatch_state.json").write_text(json.dumps({"data": {"sampler": {"samples_consumed": 48}}}))
    calls: list = []
    monkeypatch.setattr(
        resume, "ensure_universal", lambda *args: calls.append(args) or "global_step6_universal"
    )
    return folder, calls


def test_the_switch_is_set_for_the_load_and_off_after_it_and_after_a_failed_one(checkpoint):
    folder, calls = checkpoint
    universal = resume.UniversalResume()
    universal.expect(str(folder))
    first = _Engine()
    universal.engine_assigned(first, world_size=1, rank=0)
    assert first.load_universal_checkpoint() and len(calls) == 1
    (_, tag, _, record) = calls[0]
    assert tag == "global_step6" and (record.world_size, record.global_steps, record.global_samples) == (
        2,
        6,
        48,
    )
    # The load failed (loaded() never ran); the next train() resumes again with a new engine.
    universal.expect(str(folder))
    assert not first.load_universal_checkpoint(), "the failed load's engine is switched off"
    second = _Engine()
    universal.engine_assigned(second, world_size=1, rank=0)
    assert second.load_universal_checkpoint() and len(calls) == 2
    universal.loaded()
    assert not second.load_universal_checkpoint()


def test_nothing_is_converted_on_the_same_world_for_stage_0_or_an_engine_without_an_optimizer(checkpoint):
    folder, calls = checkpoint
    universal = resume.UniversalResume()
    for engine, world in [(_Engine(), 2), (_Engine(stage=0), 1), (_Engine(groups=None), 1)]:
        universal.expect(str(folder))
        universal.engine_assigned(engine, world_size=world, rank=0)
        assert not engine.load_universal_checkpoint() and not calls
    # Expected once: an engine assigned later (evaluate's, after training) finds nothing pending.
    universal.expect(str(folder))
    universal.engine_assigned(trained := _Engine(), world_size=1, rank=0)
    universal.loaded()
    universal.engine_assigned(later := _Engine(), world_size=1, rank=0)
    assert trained is not later and not later.load_universal_checkpoint() and len(calls) == 1


def test_zero_3_with_several_parameter_groups_is_refused_with_what_to_do(checkpoint):
    # DeepSpeed 0.19.8's ZeRO 3 universal load restores only the first group's optimizer state rightly.
    folder, calls = checkpoint
    universal = resume.UniversalResume()
    for engine in (_Engine(groups=2, stage=2), _Engine(groups=1, stage=3)):
        universal.expect(str(folder))
        universal.engine_assigned(engine, world_size=1, rank=0)
        assert engine.load_universal_checkpoint()
        universal.loaded()
    universal.expect(str(folder))
    with pytest.raises(
        ValueError, match="2 parameter groups under ZeRO 3.*resume on 2 ranks.*one parameter group"
    ):
        universal.engine_assigned(_Engine(groups=2, stage=3), world_size=1, rank=0)
    assert len(calls) == 2, "refused before any conversion"


def test_the_best_model_written_before_a_resume_is_loaded_through_the_universal_copy(checkpoint):
    folder, calls = checkpoint
    universal = resume.UniversalResume()
    engine, args = _Engine(), SimpleNamespace(world_size=1, process_index=0)
    with universal.loading(str(folder), engine, args):
        assert engine.load_universal_checkpoint() and len(calls) == 1
    assert not engine.load_universal_checkpoint()
    with universal.loading(str(folder), None, args):  # no DeepSpeed: nothing to do
        pass
    assert len(calls) == 1
