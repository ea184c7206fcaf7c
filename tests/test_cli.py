"""``ds-adabatch`` end to end through a subprocess (exit codes, output, no tracebacks), plus helpers."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from ds_adabatch import cli

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(str(p) for p in (ROOT / "ds_configs").glob("*.json"))
ZERO0 = str(ROOT / "ds_configs" / "zero0.json")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "ds_adabatch.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert "Traceback" not in result.stderr, f"a traceback reached the user:\n{result.stderr}"
    return result


def write(path: Path, config: dict) -> str:
    path.write_text(json.dumps(config))
    return str(path)


def test_version() -> None:
    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"ds-adabatch {cli.__version__}"


def test_validate_examples_with_world_sizes() -> None:
    # The pipeline config (2 stages) needs an even number of processes: checked with 2 and 8.
    plain = [p for p in EXAMPLES if not p.endswith("pipe_ramp.json")]
    result = run("validate", *plain, "--world-size", "1,2,8")
    assert result.returncode == 0, result.stderr
    for path in plain:
        assert f"ok: {path}" in result.stdout
    piped = run("validate", str(ROOT / "ds_configs" / "pipe_ramp.json"), "--world-size", "2,8")
    assert piped.returncode == 0, piped.stderr
    assert "world size 8: start global 16 = micro 2 x gas 1 on 8 ranks" in result.stdout
    assert "train_batch_size=" in result.stdout


def test_validate_says_what_auto_resolves_to(tmp_path: Path) -> None:
    shipped = run("validate", str(ROOT / "ds_configs" / "goodput.json"))
    assert shipped.returncode == 0, shipped.stderr
    assert (
        '"auto" resolves to: efficiency "sqrt" (lr_scaling.rule "adascale", gain_power 0.5); '
        'geometry "adam" (the ds_config\'s optimizer AdamW, where its second moments can be read)'
    ) in shipped.stdout
    section = {
        "schedule": {"type": "goodput", "start": 8},
        "max_global_batch": 64,
        "max_micro_batch_per_gpu": 8,
    }
    client = write(tmp_path / "client.json", {"adabatch": {**section, "lr_scaling": {"rule": "linear"}}})
    sgd = {"adabatch": {**section, "schedule": {**section["schedule"], "efficiency": "sqrt"}}}
    sgd["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    named = write(tmp_path / "sgd.json", sgd)
    result = run("validate", client, named)
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stdout.splitlines() if "resolves to" in line]
    assert said == [
        '  "auto" resolves to: efficiency "linear" (lr_scaling.rule "linear"); geometry from the optimizer at '
        'run time ("adam" where it keeps Adam\'s second moment, else "sgd")',
        '  "auto" resolves to: geometry "sgd" (the ds_config\'s optimizer SGD)',
    ], result.stdout


def test_validate_reports_every_problem_of_every_file(tmp_path: Path) -> None:
    bad = write(
        tmp_path / "bad.json",
        {
            "train_batch_size": 32,
            "adabatch": {
                "schedule": {"type": "linear", "start": 16, "end": 64, "ramp_samples": 0},
                "max_micro_batch_per_gpu": 0,
                "data": {"shufle": True},
            },
        },
    )
    broken = tmp_path / "broken.json"
    broken.write_text('{"adabatch": {,}}')
    result = run("validate", ZERO0, bad, str(broken), str(tmp_path / "missing.json"))
    assert result.returncode == 2
    assert f"ok: {ZERO0}" in result.stdout
    for needle in (
        f"invalid: {bad}",
        "adabatch.schedule: ramp_samples must be > 0",
        "adabatch.max_micro_batch_per_gpu: must be >= 1",
        "adabatch.data.shufle: is not a known key: did you mean 'shuffle'",
        "invalid JSON at line 1, column 15",
        "file not found",
        "3 of 4 configs have problems",
    ):
        assert needle in result.stderr, f"{needle!r} not in stderr:\n{result.stderr}"


def test_validate_fails_for_an_unplannable_world_size(tmp_path: Path) -> None:
    config = write(
        tmp_path / "c.json",
        {"adabatch": {"schedule": {"type": "constant", "value": 16}, "max_micro_batch_per_gpu": 4}},
    )
    result = run("validate", config, "--world-size", "2,3")
    assert result.returncode == 2
    assert "with --world-size 3" in result.stderr
    assert "adabatch.schedule.value: cannot be planned on 3 ranks" in result.stderr
    assert "15, 18" in result.stderr


def test_plan_table() -> None:
    result = run("plan", "--global-batch", "17", "--world-size", "2", "--max-micro", "4", "--uneven")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[2].split() == ["rank", "step", "0", "step", "1", "step", "2", "samples", "per", "rank"]
    assert lines[3].split() == ["0", "3", "3", "3", "9"]
    assert lines[4].split() == ["1", "3", "3", "2", "8"]
    assert "global 17 = micro 3 x gas 3 on 2 ranks (uneven)" in lines[-1]
    assert "train_batch_size=18" in lines[-1]


PIPE = str(ROOT / "ds_configs" / "pipe_ramp.json")


def test_validate_plans_for_the_replicas_a_pipeline_leaves(tmp_path: Path) -> None:
    # pipe_ramp.json says "pipeline": {"stages": 2}: 2 processes are one replica, 4 are two.
    result = run("validate", PIPE, "--world-size", "2,4")
    assert result.returncode == 0, result.stderr
    assert "layout: 2 pipeline stage(s) x 1 tensor rank(s) per replica" in result.stdout
    assert (
        "world size 2 (1 data-parallel replica): start global 8 = micro 8 x gas 1 on 1 rank" in result.stdout
    )
    assert "world size 4 (2 data-parallel replicas): start global 8 = micro 4 x gas 1" in result.stdout
    # The layout from flags on a config without one; a world size the layout does not divide.
    result = run(
        "validate", ZERO0, "--world-size", "8", "--pipeline-stages", "2", "--tensor-parallel-size", "2"
    )
    assert result.returncode == 0, result.stderr
    assert "world size 8 (2 data-parallel replicas)" in result.stdout
    result = run("validate", PIPE, "--world-size", "3")
    assert result.returncode == 2
    assert "--world-size 3 is not a multiple of the processes of one replica" in result.stderr


def test_validate_refuses_what_initialize_refuses_for_a_layout(tmp_path: Path) -> None:
    config = json.loads(Path(PIPE).read_text())
    config["zero_optimization"] = {"stage": 2}
    config["adabatch"]["schedule"] = {"type": "gradient_noise", "start": 8}
    bad = write(tmp_path / "pipe_z2.json", config)
    result = run("validate", bad, "--world-size", "2")
    assert result.returncode == 2
    assert "zero_optimization.stage: DeepSpeed 0.19.8 supports ZeRO stage 0 or 1" in result.stderr
    assert "adabatch.schedule.type: gradient_noise cannot be measured" in result.stderr
    # The stage count of the flags against the config's.
    result = run("validate", PIPE, "--world-size", "4", "--pipeline-stages", "4")
    assert result.returncode == 2
    assert "pipeline.stages: the config says 2 pipeline stages" in result.stderr
    # Tensor parallelism: "auto" cannot learn the micro-batch.
    config = {"adabatch": {"schedule": {"type": "constant", "value": 16}, "max_micro_batch_per_gpu": "auto"}}
    auto = write(tmp_path / "auto.json", config)
    result = run("validate", auto, "--world-size", "4", "--tensor-parallel-size", "2")
    assert result.returncode == 2
    assert "adabatch.max_micro_batch_per_gpu" in result.stderr and "tensor" in result.stderr
    assert run("validate", auto, "--world-size", "4").returncode == 0


def test_validate_refuses_what_deepspeed_would_refuse_of_its_own_sections(tmp_path: Path) -> None:
    section = {"schedule": {"type": "constant", "value": 8}, "max_micro_batch_per_gpu": 4}
    bad = write(tmp_path / "ds_bad.json", {"zero_optimization": {"stage": 5}, "adabatch": section})
    result = run("validate", bad)
    assert result.returncode == 2 and "zero_optimization.stage" in result.stderr, result.stderr
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 2}}
    untested = write(tmp_path / "sgd.json", {**sgd, "adabatch": section})
    result = run("validate", untested)
    assert result.returncode == 2 and "zero_allow_untested_optimizer" in result.stderr, result.stderr
    allowed = write(
        tmp_path / "sgd_ok.json", {**sgd, "zero_allow_untested_optimizer": True, "adabatch": section}
    )
    assert run("validate", allowed).returncode == 0


def test_validate_checks_a_callable_schedule_beside_the_script_as_python_finds_it(tmp_path: Path) -> None:
    (tmp_path / "my_sched.py").write_text("def grow(step, batch_size, interval=5):\n    return batch_size\n")
    schedule = {"type": "callable", "function": "my_sched:grow", "start": 8}
    for kwargs, code in (({"interval": 2}, 0), ({"intervl": 2}, 2)):
        config = {"adabatch": {"schedule": {**schedule, "kwargs": kwargs}, "max_micro_batch_per_gpu": 4}}
        write(tmp_path / "cfg.json", config)
        script = Path(sys.executable).parent / "ds-adabatch"  # the console script: no cwd on sys.path
        result = subprocess.run(
            [str(script), "validate", "cfg.json"], capture_output=True, text=True, cwd=tmp_path, timeout=120
        )
        assert result.returncode == code, result.stderr
    assert (
        "unexpected keyword argument 'intervl'" in result.stderr
        and "adabatch.schedule.kwargs" in result.stderr
    )


def test_plan_counts_replicas_of_a_layout() -> None:
    result = run(
        "plan", "--global-batch", "16", "--world-size", "4", "--max-micro", "4", "--pipeline-stages", "2"
    )
    assert result.returncode == 0, result.stderr
    assert "global batch 16 on 2 data-parallel replicas (4 processes" in result.stdout
    assert "global 16 = micro 4 x gas 2 on 2 ranks" in result.stdout
    result = run(
        "plan", "--global-batch", "16", "--world-size", "3", "--max-micro", "4", "--tensor-parallel-size", "2"
    )
    assert result.returncode == 2 and "not a multiple" in result.stderr


def test_plan_infeasible_and_bad_arguments() -> None:
    result = run("plan", "--global-batch", "17", "--world-size", "2", "--max-micro", "4")
    assert result.returncode == 2
    assert "16, 18" in result.stderr and "--uneven" in result.stderr
    result = run("plan", "--global-batch", "many", "--world-size", "0", "--max-micro", "4")
    assert result.returncode == 2
    assert "--global-batch" in result.stderr


def test_schema_is_json_schema_of_the_section() -> None:
    result = run("schema")
    assert result.returncode == 0
    schema = json.loads(result.stdout)
    assert {"schedule", "max_micro_batch_per_gpu", "lr_scaling", "data", "log"} <= set(schema["properties"])
    assert schema["additionalProperties"] is False


def test_elastic_table() -> None:
    result = run("elastic", "--max-batch", "64", "--world-sizes", "1-8", "--max-micro", "8", "--top", "2")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line[:1].isdigit()]
    assert rows[0][:5] == ["1", "60", "6", "of", "8"] and rows[0][5] == "1-6"
    assert rows[1][:2] == ["2", "48"] and rows[1][5] == "1-4,6,8"
    assert "--top 0 shows all" in result.stdout


def test_elastic_bad_input() -> None:
    result = run("elastic", "--max-batch", "64", "--world-sizes", "8-1", "--max-micro", "8")
    assert result.returncode == 2
    assert "--world-sizes" in result.stderr
    result = run("elastic", "--max-batch", "3", "--world-sizes", "4-8", "--max-micro", "8")
    assert result.returncode == 2
    assert "no global batch" in result.stderr


def test_usage_errors() -> None:
    result = run()
    assert result.returncode == 2
    assert "usage:" in result.stderr
    result = run("simulate", ZERO0, "--world-size", "2", "--samples", "100")  # no --out
    assert result.returncode == 2
    assert "--out" in result.stderr


def test_cli_imports_neither_torch_nor_deepspeed() -> None:
    # validate does: it has DeepSpeed check its own sections (what deepspeed.initialize would refuse).
    code = (
        "import sys; from ds_adabatch.cli import main; "
        "rc = main(['plan', '--global-batch', '8', '--world-size', '2', '--max-micro', '4']); "
        "rc |= main(['schema']); "
        "print('heavy:', sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules)); "
        "sys.exit(rc)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "heavy: []" in result.stdout


# In-process: the simulate hook and the last-resort error handler.


def test_simulate_calls_the_simulator(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path) -> None:
    calls = []
    fake = types.ModuleType("ds_adabatch.schedules.simulate")

    def simulate(loaded, **kwargs):
        calls.append((loaded, kwargs))
        for path in (kwargs["out_png"], kwargs["out_csv"]):
            Path(path).write_text("")
        return [{"global_batch": 16}, {"global_batch": 24}]

    fake.simulate = simulate  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ds_adabatch.schedules.simulate", fake)
    out, csv = str(tmp_path / "plan.png"), str(tmp_path / "plan.csv")
    args = ["simulate", ZERO0, "--world-size", "2", "--samples", "5000", "--out", out, "--csv", csv]
    assert cli.main(args) == 0
    ((loaded, kwargs),) = calls
    assert loaded.plan is not None and loaded.plan.world_size == 2
    assert kwargs == {"world_size": 2, "samples": 5000, "out_png": out, "out_csv": csv, "replay": None}
    printed = capsys.readouterr().out
    assert "2 optimizer steps over 5000 samples on 2 ranks: global batch 16 -> 24" in printed
    assert f"wrote {out}, {csv}" in printed


def test_simulate_reports_config_errors_before_simulating(tmp_path: Path, capsys) -> None:
    bad = write(tmp_path / "bad.json", {"adabatch": {"schedule": {"type": "constant", "value": 3}}})
    assert cli.main(["simulate", bad, "--world-size", "2", "--samples", "10", "--out", "x.png"]) == 2
    err = capsys.readouterr().err
    assert "adabatch.max_micro_batch_per_gpu: is required" in err


def test_unexpected_errors_become_one_message(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(cli, "plan_batch", broken)
    assert cli.main(["plan", "--global-batch", "8", "--world-size", "2", "--max-micro", "4"]) == 2
    err = capsys.readouterr().err
    assert "unexpected error: RuntimeError: boom" in err and "Traceback" not in err
    with pytest.raises(RuntimeError):
        cli.main(["--debug", "plan", "--global-batch", "8", "--world-size", "2", "--max-micro", "4"])


@pytest.mark.parametrize(
    ("spec", "values"),
    [("4", [4]), ("1-4", [1, 2, 3, 4]), ("1-3,8, 12,2", [1, 2, 3, 8, 12]), ("16,16", [16])],
)
def test_parse_int_ranges(spec: str, values: list[int]) -> None:
    assert cli.parse_int_ranges(spec) == values


@pytest.mark.parametrize("spec", ["", "0", "4-1", "a", "1,,2", "1-", "-3"])
def test_parse_int_ranges_rejects(spec: str) -> None:
    with pytest.raises(ValueError):
        cli.parse_int_ranges(spec)


def test_format_int_ranges_inverts_parse() -> None:
    assert cli.format_int_ranges([1, 2, 3, 5, 8, 9, 12]) == "1-3,5,8,9,12"
    for spec in ("1-16", "1-3,5,7-9", "2,4,6", "1,2"):
        assert cli.parse_int_ranges(
            cli.format_int_ranges(cli.parse_int_ranges(spec))
        ) == cli.parse_int_ranges(spec)


def test_simulate_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "plan.png"
    result = run("simulate", ZERO0, "--world-size", "2", "--samples", "2000", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert out.is_file() and out.stat().st_size > 0
    assert "optimizer steps over 2000 samples on 2 ranks" in result.stdout


def test_simulate_makes_the_output_folder_and_says_which_noise_scale_it_uses(tmp_path: Path, capsys) -> None:
    config = tmp_path / "goodput.json"
    section = {
        "schedule": {"type": "goodput", "start": 8},
        "max_micro_batch_per_gpu": 16,
        "max_global_batch": 64,
    }
    config.write_text(
        json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "adabatch": section})
    )
    replay = tmp_path / "steps.jsonl"
    replay.write_text("".join(json.dumps({"samples": 8 * i, "noise_scale": 5.0}) + "\n" for i in range(40)))
    out = tmp_path / "not" / "yet" / "plan.png"
    args = ["simulate", str(config), "--world-size", "2", "--samples", "600", "--out", str(out)]
    args += ["--step-time", "fixed=0.02", "--replay", str(replay), "--noise-scale", "300"]
    assert cli.main(args) == 0
    said = capsys.readouterr().out
    assert "the noise scale is --noise-scale's (300), not --replay's" in said, said
    assert out.is_file() and out.with_suffix(".csv").is_file()
