"""The ``"adabatch"`` section and ``load_ds_config``: a catalogue of malformed configs, and valid ones."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ds_adabatch
from ds_adabatch.config import AdaBatchConfig, ConfigError, LoadedConfig, load_ds_config

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "ds_configs").glob("*.json"))


def valid_config() -> dict[str, Any]:
    return {
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "adabatch": {
            "schedule": {"type": "linear", "start": 16, "end": 64, "ramp_samples": 1000},
            "max_micro_batch_per_gpu": 8,
        },
    }


def edit(**changes: Any) -> Callable[[dict], None]:
    """A mutation that sets ``adabatch`` keys (dotted names reach into sub-sections)."""

    def apply(cfg: dict) -> None:
        for dotted, value in changes.items():
            node = cfg["adabatch"]
            *parents, last = dotted.split("__")
            for key in parents:
                node = node.setdefault(key, {})
            node[last] = value

    return apply


def top(**changes: Any) -> Callable[[dict], None]:
    return lambda cfg: cfg.update(changes)


def drop(*path: str) -> Callable[[dict], None]:
    def apply(cfg: dict) -> None:
        node = cfg
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return apply


LINEAR = "adabatch.schedule"

# (id, mutation of valid_config(), world size, dotted path the error must name)
CATALOGUE = [
    ("no-adabatch", drop("adabatch"), None, "adabatch"),
    ("adabatch-not-object", top(adabatch=[1, 2]), None, "adabatch"),
    ("no-schedule", drop("adabatch", "schedule"), None, LINEAR),
    ("schedule-not-object", edit(schedule=32), None, LINEAR),
    ("schedule-unknown-type", edit(schedule={"type": "cosine", "start": 1}), None, f"{LINEAR}.type"),
    ("schedule-no-type", edit(schedule={"value": 16}), None, f"{LINEAR}.type"),
    ("linear-start-zero", edit(schedule__start=0), None, f"{LINEAR}.start"),
    ("linear-missing-end", drop("adabatch", "schedule", "end"), None, f"{LINEAR}.end"),
    ("linear-typo-key", edit(schedule__stat=16), None, f"{LINEAR}.stat"),
    ("linear-no-ramp", edit(schedule__ramp_samples=0), None, LINEAR),
    ("constant-string-value", edit(schedule={"type": "constant", "value": "32"}), None, f"{LINEAR}.value"),
    ("constant-float-value", edit(schedule={"type": "constant", "value": 32.5}), None, f"{LINEAR}.value"),
    ("no-max-micro", drop("adabatch", "max_micro_batch_per_gpu"), None, "adabatch.max_micro_batch_per_gpu"),
    ("max-micro-zero", edit(max_micro_batch_per_gpu=0), None, "adabatch.max_micro_batch_per_gpu"),
    ("max-micro-bool", edit(max_micro_batch_per_gpu=True), None, "adabatch.max_micro_batch_per_gpu"),
    ("min-global-zero", edit(min_global_batch=0), None, "adabatch.min_global_batch"),
    ("max-global-string", edit(max_global_batch="64"), None, "adabatch.max_global_batch"),
    ("granularity-zero", edit(granularity=0), None, "adabatch.granularity"),
    ("allow-uneven-string", edit(allow_uneven="yes"), None, "adabatch.allow_uneven"),
    ("update-interval-zero", edit(update_interval=0), None, "adabatch.update_interval"),
    ("max-change-factor-one", edit(max_change_factor=1.0), None, "adabatch.max_change_factor"),
    ("lr-rule-unknown", edit(lr_scaling__rule="cubic"), None, "adabatch.lr_scaling.rule"),
    ("lr-reference-zero", edit(lr_scaling__reference_batch=0), None, "adabatch.lr_scaling.reference_batch"),
    # AdaScale's gain reads the noise scale, which a linear ramp never measures.
    ("lr-adascale-without-noise", edit(lr_scaling__rule="adascale"), None, "adabatch.lr_scaling.rule"),
    ("lr-gain-power-zero", edit(lr_scaling__gain_power=0.0), None, "adabatch.lr_scaling.gain_power"),
    ("lr-gain-power-above-one", edit(lr_scaling__gain_power=1.5), None, "adabatch.lr_scaling.gain_power"),
    ("lr-scaling-typo", edit(lr_scaling__refrence_batch=64), None, "adabatch.lr_scaling.refrence_batch"),
    (
        "lr-reference-unused",
        edit(lr_scaling__reference_batch=64),
        None,
        "adabatch.lr_scaling.reference_batch",
    ),
    ("lr-unit-unknown", edit(lr_schedule_unit="tokens"), None, "adabatch.lr_schedule_unit"),
    ("loss-normalization-unknown", edit(loss_normalization="mean"), None, "adabatch.loss_normalization"),
    ("data-workers-negative", edit(data__num_workers=-1), None, "adabatch.data.num_workers"),
    ("data-seed-float", edit(data__seed=1.5), None, "adabatch.data.seed"),
    ("data-shuffle-string", edit(data__shuffle="true"), None, "adabatch.data.shuffle"),
    ("data-not-object", edit(data=True), None, "adabatch.data"),
    ("log-jsonl-number", edit(log__jsonl=5), None, "adabatch.log.jsonl"),
    ("unknown-section-key", edit(max_global_bach=64), None, "adabatch.max_global_bach"),
    ("min-above-max", edit(min_global_batch=64, max_global_batch=32), None, "adabatch.min_global_batch"),
    ("start-below-min", edit(min_global_batch=32), None, f"{LINEAR}.start"),
    ("end-above-max", edit(max_global_batch=48), None, f"{LINEAR}.end"),
    ("end-off-granularity", edit(granularity=16, schedule__end=72), None, f"{LINEAR}.end"),
    (
        "bounds-admit-no-multiple",
        edit(granularity=16, min_global_batch=33, max_global_batch=47),
        None,
        "adabatch.max_global_batch",
    ),
    ("elasticity-section", top(elasticity={"enabled": True}), None, "elasticity"),
    ("train-batch-mismatch", top(train_batch_size=32), None, "train_batch_size"),
    ("train-batch-not-number", top(train_batch_size="big"), None, "train_batch_size"),
    ("micro-above-max-micro", top(train_micro_batch_size_per_gpu=16), None, "train_micro_batch_size_per_gpu"),
    ("micro-mismatch-plan", top(train_micro_batch_size_per_gpu=4), 2, "train_micro_batch_size_per_gpu"),
    ("gas-mismatch-plan", top(gradient_accumulation_steps=4), 2, "gradient_accumulation_steps"),
    ("gas-zero", top(gradient_accumulation_steps=0), None, "gradient_accumulation_steps"),
    ("batch-below-world", edit(schedule={"type": "constant", "value": 16}), 32, f"{LINEAR}.value"),
    ("batch-not-divisible", edit(schedule={"type": "constant", "value": 16}), 3, f"{LINEAR}.value"),
    ("end-not-divisible", edit(schedule__end=70), 4, f"{LINEAR}.end"),
    (
        "bounds-empty-for-world",  # multiples of lcm(8, 6) = 24: none between 32 and 40
        edit(
            schedule={"type": "constant", "value": 32},
            granularity=8,
            min_global_batch=32,
            max_global_batch=40,
        ),
        6,
        "adabatch.max_global_batch",
    ),
    (
        "piecewise-point-zero",
        edit(schedule={"type": "piecewise", "points": [[0, 16], [100, 0]]}),
        None,
        f"{LINEAR}.points[1][1]",
    ),
    (
        "per-device-start-off-granularity",  # 3 per device on 2 ranks is a global batch of 6
        edit(
            schedule={"type": "callable", "function": "pkg.mod:fn", "start": 3, "per": "device"},
            granularity=4,
        ),
        2,
        f"{LINEAR}.start",
    ),
    ("not-a-ds-config", lambda cfg: cfg.clear() or cfg.update(adabatch=None), None, "adabatch"),
]


@pytest.mark.parametrize(
    ("mutate", "world_size", "path"), [c[1:] for c in CATALOGUE], ids=[c[0] for c in CATALOGUE]
)
def test_malformed_config_names_its_path(
    mutate: Callable[[dict], None], world_size: int | None, path: str
) -> None:
    cfg = valid_config()
    mutate(cfg)
    with pytest.raises(ConfigError) as info:
        load_ds_config(cfg, world_size=world_size)
    err = info.value
    assert path in err.paths, f"expected a problem at {path!r}, got {err.paths}:\n{err}"
    assert f"  - {path}: " in str(err), f"the message does not name {path!r}:\n{err}"
    assert isinstance(err, ValueError)


def test_catalogue_is_large_enough() -> None:
    assert len(CATALOGUE) >= 25
    assert len({c[0] for c in CATALOGUE}) == len(CATALOGUE)


def test_all_problems_are_listed_at_once() -> None:
    cfg = valid_config()
    cfg["elasticity"] = {"enabled": True}
    cfg["train_batch_size"] = "lots"
    ada = cfg["adabatch"]
    ada["data"] = {"num_workers": -2, "shufle": False}
    ada["lr_scaling"] = {"rule": "cubic"}
    ada["min_global_batch"] = 32  # start 16 is below it: a cross-field check next to field errors
    with pytest.raises(ConfigError) as info:
        load_ds_config(cfg)
    paths = info.value.paths
    for expected in (
        "elasticity",
        "train_batch_size",
        "adabatch.data.num_workers",
        "adabatch.data.shufle",
        "adabatch.lr_scaling.rule",
        "adabatch.schedule.start",
    ):
        assert expected in paths, f"{expected} missing from {paths}"
    assert str(info.value).startswith(f"{len(paths)} problems in ds_config dict:")


def test_cross_checks_run_despite_a_broken_schedule() -> None:
    cfg = valid_config()
    cfg["adabatch"].update(schedule={"type": "linear", "sta": 3}, min_global_batch=64, max_global_batch=32)
    with pytest.raises(ConfigError) as info:
        load_ds_config(cfg)
    paths = info.value.paths
    assert {"adabatch.schedule.sta", "adabatch.schedule.start", "adabatch.min_global_batch"} <= set(paths)
    assert len(paths) == len(set(paths)) == 5, paths  # sta, start, end, ramp_samples, min > max


def test_a_key_given_with_the_wrong_type_is_not_also_reported_missing() -> None:
    # goodput requires max_global_batch: a string there is one problem (its type), not also "required".
    cfg = valid_config()
    cfg["adabatch"].update(schedule={"type": "goodput", "start": 8}, max_global_batch="256")
    with pytest.raises(ConfigError) as info:
        load_ds_config(cfg)
    assert info.value.paths == ["adabatch.max_global_batch"], str(info.value)
    assert "must be an integer" in str(info.value) and "is required" not in str(info.value)
    del cfg["adabatch"]["max_global_batch"]  # absent, it is required
    with pytest.raises(ConfigError, match="is required by the goodput schedule"):
        load_ds_config(cfg)


def test_messages_say_what_would_be_valid() -> None:
    cases = [
        (top(train_batch_size=32), None, ['set it to "auto"', "16", "32"]),
        (edit(data__shufle=True), None, ["did you mean 'shuffle'"]),
        (edit(schedule={"type": "cosine"}), None, ["'constant'", "'linear'"]),
        (edit(granularity=16, schedule__end=72), None, ["use 64 or 80"]),
        (edit(schedule={"type": "constant", "value": 17}), 2, ["16, 18", "allow_uneven"]),
        (edit(schedule={"type": "constant", "value": 4}), 8, ["allow_uneven"]),
        # The suggestions respect granularity and bounds: 12 and 24 are the multiples of lcm(6, 4) around 18.
        (edit(granularity=6, schedule={"type": "constant", "value": 18}), 4, ["are 12, 24", "granularity 6"]),
        (
            edit(granularity=6, max_global_batch=20, schedule={"type": "constant", "value": 18}),
            4,
            ["are 12 (multiples of 12"],
        ),
        (top(elasticity={}), None, ["0.19.8", "ds-adabatch elastic"]),
        (drop("adabatch", "max_micro_batch_per_gpu"), None, ["is required", "samples"]),
    ]
    for mutate, world_size, needles in cases:
        cfg = valid_config()
        mutate(cfg)
        with pytest.raises(ConfigError) as info:
            load_ds_config(cfg, world_size=world_size)
        for needle in needles:
            assert needle in str(info.value), f"{needle!r} not in:\n{info.value}"


def test_uneven_plan_accepts_real_or_padded_train_batch_size() -> None:
    cfg = valid_config()
    cfg["adabatch"].update(
        schedule={"type": "constant", "value": 14}, max_micro_batch_per_gpu=4, allow_uneven=True
    )
    for written in (14, 16, "auto"):
        loaded = load_ds_config({**cfg, "train_batch_size": written}, world_size=1)
        assert loaded.deepspeed["train_batch_size"] == 16  # DeepSpeed sees the padded shape
    with pytest.raises(ConfigError, match="14 \\(real samples\\) or 16 \\(the padded shape"):
        load_ds_config({**cfg, "train_batch_size": 15}, world_size=1)
    # Without a world size the padded value is unknown, so any number waits for with_world_size.
    load_ds_config({**cfg, "train_batch_size": 15})


def test_file_problems(tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    with pytest.raises(ConfigError, match="file not found") as info:
        load_ds_config(missing)
    assert str(missing) in str(info.value)

    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "adabatch": {\n    "schedule": {"type": "constant",\n}\n')
    with pytest.raises(ConfigError, match=r"invalid JSON at line 4, column 1"):
        load_ds_config(bad)

    # DeepSpeed reads config files as hjson: comments and trailing commas are accepted, and the
    # file's real problems are reported.
    lenient = tmp_path / "lenient.json"
    lenient.write_text('{\n  // comment\n  "adabatch": {\n    "schedule": 3,\n  }\n}\n')
    with pytest.raises(ConfigError) as info:
        load_ds_config(lenient)
    assert "adabatch.schedule" in str(info.value) and "invalid JSON" not in str(info.value)
    commented = tmp_path / "commented.json"
    commented.write_text(
        '{\n  // global batch ramps 8 -> 64\n  "adabatch": {"schedule": {"type": "linear", "start": 8,'
        ' "end": 64, "ramp_samples": 100}, "max_micro_batch_per_gpu": 8}\n}\n'
    )
    assert load_ds_config(commented, world_size=2).plan.global_batch_size == 8

    array = tmp_path / "array.json"
    array.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="top level must be a JSON object"):
        load_ds_config(array)

    dup = tmp_path / "dup.json"
    dup.write_text('{"train_batch_size": 8, "train_batch_size": 16, "adabatch": {}}')
    with pytest.raises(ConfigError, match="duplicate key 'train_batch_size'"):
        load_ds_config(dup)

    with pytest.raises(ConfigError, match="is a directory"):
        load_ds_config(tmp_path)
    with pytest.raises(ConfigError, match="expected a path"):
        load_ds_config(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as info:
        load_ds_config(valid_config(), world_size=0)
    assert info.value.paths == ["world_size"]


def test_valid_config_loads_and_fills_batch_keys() -> None:
    cfg = valid_config()
    cfg["train_batch_size"] = "auto"
    before = copy.deepcopy(cfg)
    loaded = load_ds_config(cfg)
    assert cfg == before, "load_ds_config modified its argument"
    assert loaded.plan is None and loaded.world_size is None
    assert "adabatch" not in loaded.deepspeed
    assert loaded.deepspeed["train_batch_size"] == "auto"  # untouched without a world size
    assert loaded.source == "ds_config dict"

    planned = loaded.with_world_size(2)
    assert planned.plan is not None and planned.world_size == 2
    assert planned.deepspeed == {
        **{k: v for k, v in cfg.items() if k != "adabatch"},
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
    }
    assert planned == load_ds_config(cfg, world_size=2)
    planned.deepspeed["gradient_clipping"] = 0.0
    assert planned.with_world_size(2).deepspeed["gradient_clipping"] == 1.0, "state leaked between results"


def test_a_world_the_config_was_not_chosen_for_rounds_instead_of_refusing() -> None:
    cfg = {
        "train_batch_size": 9,
        "train_micro_batch_size_per_gpu": 3,
        "adabatch": {"schedule": {"type": "constant", "value": 9}, "max_micro_batch_per_gpu": 4},
    }
    loaded = load_ds_config(cfg)
    assert loaded.with_world_size(3).plan.global_batch_size == 9
    with pytest.raises(ConfigError, match="adabatch.schedule.value"):
        loaded.with_world_size(2)  # a start on 2 ranks: the schedule is wrong for it
    # The survivors of a live recovery on 2 ranks: 9 rounds to 10 (ties up, as the controller rounds),
    # and the batch keys written for 3 ranks are replaced by the plan's.
    survivors = loaded.with_world_size(2, rounds=True)
    assert survivors.plan.global_batch_size == 10 and survivors.deepspeed["train_batch_size"] == 10
    assert (
        survivors.deepspeed["train_micro_batch_size_per_gpu"]
        * survivors.deepspeed["gradient_accumulation_steps"]
        * 2
        == 10
    )


def test_numeric_batch_keys_are_refused_with_token_budgets() -> None:
    section = {"schedule": {"type": "constant", "value": 40, "unit": "tokens"}, "micro_batch_tokens": 16}
    with pytest.raises(ConfigError) as err:
        load_ds_config({"train_micro_batch_size_per_gpu": 40, "train_batch_size": 40, "adabatch": section})
    assert set(err.value.paths) == {"train_micro_batch_size_per_gpu", "train_batch_size"}, str(err.value)
    assert "micro_batch_tokens" in str(err.value) and '"auto"' in str(err.value)
    assert load_ds_config({"train_batch_size": "auto", "adabatch": section}, world_size=2).plan is not None


def test_deepspeeds_dataloader_drop_last_applies_unless_the_section_sets_it() -> None:
    section = {"schedule": {"type": "constant", "value": 8}, "max_micro_batch_per_gpu": 4}
    plain = load_ds_config({"dataloader_drop_last": True, "adabatch": section})
    assert not plain.adabatch.data.drop_last, "the Trainer and accelerate read the section as written"
    assert plain.honouring_deepspeed_drop_last().adabatch.data.drop_last
    assert plain.honouring_deepspeed_drop_last().with_world_size(2).adabatch.data.drop_last
    assert (
        load_ds_config({"adabatch": section}).honouring_deepspeed_drop_last().adabatch.data.drop_last is False
    )
    both = {**section, "data": {"drop_last": True}}
    assert load_ds_config({"dataloader_drop_last": True, "adabatch": both}).honouring_deepspeed_drop_last()
    with pytest.raises(ConfigError) as err:
        load_ds_config({"dataloader_drop_last": False, "adabatch": both}).honouring_deepspeed_drop_last()
    assert err.value.paths == ["dataloader_drop_last"] and "adabatch.data.drop_last" in str(err.value)


def test_deepspeed_keys_inside_the_section_are_sent_to_the_top_level() -> None:
    section = {
        "schedule": {"type": "constant", "value": 8},
        "max_micro_batch_per_gpu": 4,
        "zero_optimization": {},
    }
    with pytest.raises(ConfigError) as err:
        load_ds_config({"adabatch": section})
    assert err.value.paths == ["adabatch.zero_optimization"] and "top level" in str(err.value), str(err.value)


def test_gain_power_without_adascale_is_refused() -> None:
    section = {"schedule": {"type": "constant", "value": 8}, "max_micro_batch_per_gpu": 4}
    with pytest.raises(ConfigError) as err:
        load_ds_config({"adabatch": {**section, "lr_scaling": {"rule": "linear", "gain_power": 1.0}}})
    assert err.value.paths == ["adabatch.lr_scaling.gain_power"] and "'adascale'" in str(err.value)


def test_section_keys_at_the_top_level_are_refused() -> None:
    section = {"schedule": {"type": "constant", "value": 8}, "max_micro_batch_per_gpu": 4}
    with pytest.raises(ConfigError) as err:
        load_ds_config(
            {"adabatch": section, "live_elastic": {"enabled": True}, "lr_scaling": {"rule": "sqrt"}}
        )
    assert sorted(err.value.paths) == ["live_elastic", "lr_scaling"] and 'inside "adabatch"' in str(err.value)


def test_defaults_and_round_trip() -> None:
    cfg = load_ds_config(valid_config()).adabatch
    assert (cfg.granularity, cfg.allow_uneven, cfg.update_interval) == (1, False, 1)
    assert (cfg.min_global_batch, cfg.max_global_batch, cfg.max_change_factor) == (None, None, None)
    assert (cfg.lr_scaling.rule, cfg.lr_scaling.reference_batch) == ("none", None)
    assert (cfg.lr_schedule_unit, cfg.loss_normalization) == ("steps", "sample")
    assert (cfg.data.shuffle, cfg.data.seed, cfg.data.drop_last, cfg.data.num_workers) == (True, 0, False, 0)
    assert cfg.log.jsonl is None
    dumped = json.loads(json.dumps(cfg.model_dump(mode="json")))
    assert AdaBatchConfig.model_validate(dumped) == cfg
    assert load_ds_config({"adabatch": dumped}).adabatch == cfg


def test_every_field_is_described() -> None:
    from ds_adabatch.config import DataConfig, LogConfig, LrScalingConfig

    for model in (AdaBatchConfig, LrScalingConfig, DataConfig, LogConfig):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"
        assert model.model_config.get("extra") == "forbid"
    schema = AdaBatchConfig.model_json_schema()
    # max_micro_batch_per_gpu may be replaced by micro_batch_tokens; the cross-check requires one.
    assert schema["required"] == ["schedule"]


def test_package_exports() -> None:
    assert ds_adabatch.load_ds_config is load_ds_config
    assert ds_adabatch.LoadedConfig is LoadedConfig
    assert ds_adabatch.AdaBatchConfig is AdaBatchConfig
    assert ds_adabatch.ConfigError is ConfigError


def test_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"zero0.json", "zero1.json", "zero2.json", "zero3.json", "zero2_offload.json"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
@pytest.mark.parametrize("world_size", [None, 1, 2, 8])
def test_examples_validate(path: Path, world_size: int | None) -> None:
    loaded = load_ds_config(path, world_size=world_size)
    raw = json.loads(path.read_text())
    assert raw["zero_optimization"]["stage"] in (0, 1, 2, 3)
    assert raw.get("bf16", {}).get("enabled") is False
    assert "gradient_clipping" in raw
    if world_size is not None:
        keys = loaded.deepspeed
        product = keys["train_micro_batch_size_per_gpu"] * keys["gradient_accumulation_steps"] * world_size
        assert keys["train_batch_size"] == product, (
            "DeepSpeed rejects train_batch_size != micro x gas x world"
        )


def test_examples_are_valid_deepspeed_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig

    for path in EXAMPLES:
        # Without a process group DeepSpeedConfig assumes one rank.
        ds = load_ds_config(path, world_size=1).deepspeed
        parsed = DeepSpeedConfig(ds)
        assert parsed.train_batch_size == ds["train_batch_size"], path.name
