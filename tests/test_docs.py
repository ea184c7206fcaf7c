"""Every code block of README.md and docs/*.md is exercised, and every relative link resolves.

A fenced block is either run here or points at the tested file that holds it:

* ``python``: run. A block that builds an engine or a Trainer runs in one ``torchrun`` launch of 2 CPU
  ranks shared by all such blocks (each in a fresh namespace, in page order, ``ds_adabatch.finish()``
  ending the block instead of the process); any other block runs as ``python block.py``.
* ``bash``: run in a scratch folder that sees the checkout's folders, except ``pip install`` lines (the
  extras they name must exist in setup.py) and ``curl`` lines (checked, not fetched: no network).
* ``json``: parsed, and validated as ds_adabatch validates it when it holds an ``"adabatch"`` section
  (or is one).
* A block right under ``<!-- tested-by: FILE [FILE ...] -->`` (or ``same-as:``) is not run: each of its
  non-blank lines (a diff's added and context lines; for commands, the program, scripts, subcommand and
  option names) must occur in one of the files, and each file must be run by a test (its name appears in
  tests/, or it is CI's ``.ci/run``). ``same-as: above`` names the blocks run earlier on the same page; a
  ``.json`` file is compared by value.
* A block of sample output under ``<!-- output-of: above -->`` must match, numbers aside, what the block
  run just above it printed; under ``<!-- output-of: FILE -->``, what FILE printed when this test ran it.

A block with none of these fails with its page and line. docs/config.md is generated from the config
models and checked by its own test; only its links are checked here.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GENERATED = {"docs/config.md"}  # ds-adabatch config-docs writes it; its own test checks it is current
README_MAX_LINES = 300
MARK = "@@docs-job"

# Files this test runs itself (in the launch below), besides the pages' blocks.
RUN_HERE = {
    # the seed demo, as docs/trainer.md runs it (shortened with --max_steps)
    "runners/hf_trainer_example.py": [
        ["--deepspeed", "ds_configs/hf_zero2_noise.json", "--use_config_schedule", "--max_steps", "4"],
    ],
    # the run_clm.py-shaped script whose banner docs/trainer.md shows (2 epochs of 64 blocks, ZeRO-2)
    "tests/hf_clm_script.py": [
        ["--deepspeed", "ds_configs/hf_zero2.json", "--num_train_epochs", "2", "--train_blocks", "256"]
        + ["--use_cpu", "true"]
        + ["--per_device_train_batch_size", "4", "--log_level", "info", "--output_dir", "clm_out"]
        + ["--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no"],
    ],
}
# Commands that take minutes or machines (launchers, images, training runs) are never run here: a
# block holding one must point at the test that runs it.
LONG_RUNNING = re.compile(r"(^|[\s/])(torchrun|deepspeed|podman|docker|kubectl)\s|scripts/\S+\.sh|runners/")
MARKER = re.compile(r"<!--\s*(tested-by|same-as|output-of):\s*(.*?)\s*-->")
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # path relative to the checkout
    line: int  # line of the opening fence (1-based)
    lang: str
    text: str
    marker: tuple[str, str] | None  # (kind, argument) of the comment right above the fence

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, with the marker comment right above each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    page = path.relative_to(ROOT).as_posix()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not fence:
            i += 1
            continue
        start, close = i, fence.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(close):
            j += 1
        above = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        found = MARKER.search(above)
        marker = (found.group(1), found.group(2)) if found else None
        blocks.append(Block(page, start + 1, fence.group(2).lower(), "\n".join(lines[i + 1 : j]), marker))
        i = j + 1
    return blocks


ALL_BLOCKS = {p.relative_to(ROOT).as_posix(): parse_blocks(p) for p in PAGES}
BLOCKS = [b for page, bs in ALL_BLOCKS.items() if page not in GENERATED for b in bs]


def _kind(block: Block) -> str:
    if block.marker is not None:
        return "output" if block.marker[0] == "output-of" else "text"
    if block.lang == "python":
        return "launch" if _needs_launch(block.text) else "python"
    if block.lang in ("bash", "sh", "shell"):
        return "bash"
    if block.lang == "json":
        return "json"
    return "none"


def _needs_launch(text: str) -> bool:
    return bool(
        re.search(r"ds_adabatch\.initialize|AdaptiveBatchSizeTrainer|ds_adabatch\.init_distributed", text)
    )


def _ids(blocks: list[Block]) -> list[str]:
    return [b.where for b in blocks]


def _of(kind: str) -> list[Block]:
    return [b for b in BLOCKS if _kind(b) == kind]


# -- every block has a way -------------------------------------------------------------------------------


def test_every_block_is_run_or_points_at_a_tested_file():
    missing = [
        f"{b.where}: a ```{b.lang or 'text'} block with no way to exercise it: run it (python, bash, json) "
        "or put <!-- tested-by: FILE --> / <!-- output-of: above --> right above it"
        for b in BLOCKS
        if _kind(b) == "none"
    ]
    long_running = [
        f"{b.where}: runs a long command ({LONG_RUNNING.search(b.text).group(0).strip()}): point it at the "
        "test that runs it with <!-- tested-by: tests/... -->"
        for b in BLOCKS
        if _kind(b) == "bash" and LONG_RUNNING.search(_without_checked_lines(b.text))
    ]
    assert not missing + long_running, "\n".join(missing + long_running)


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the front door keeps to 300"


# -- links --------------------------------------------------------------------------------------------------


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page."""
    out = set()
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if re.match(r"^ {0,3}(`{3,}|~{3,})", line):
            in_fence = not in_fence
        if in_fence or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        out.add(slug)
    return out


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_point_at_files_that_exist(page):
    path = ROOT / page
    text = re.sub(r"(?ms)^ {0,3}```.*?^ {0,3}```", "", path.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if ROOT in dest.parents else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: {dest.name} has no heading with anchor #{anchor}")
    assert not broken, f"{page}: broken links:\n" + "\n".join(broken)


# -- blocks that point at a tested file ----------------------------------------------------------------------


def _norm(line: str) -> str:
    return " ".join(line.split())


def _tested_files(block: Block) -> list[str]:
    return block.marker[1].split() if block.marker else []


def _is_run_by_a_test(rel: str) -> bool:
    if rel == ".ci/run" or re.fullmatch(r"tests/test_\w+\.py", rel) or rel in RUN_HERE:
        return True
    name, stem = Path(rel).name, Path(rel).stem
    imported = (
        re.compile(rf"^\s*(from {stem} import|import {stem}\b)", re.M) if rel.startswith("tests/") else None
    )
    for test in HERE.glob("*.py"):
        if test.name == Path(__file__).name:
            continue
        text = test.read_text(encoding="utf-8")
        if name in text or (imported is not None and imported.search(text)):
            return True
    return False


def _code_lines(block: Block) -> list[str]:
    """The lines a block's tested file must hold: a diff's added and context lines, no elisions."""
    out = []
    for line in block.text.splitlines():
        if block.lang == "diff":
            if line.startswith("-"):
                continue
            line = line[1:]
        if _norm(line) and _norm(line) not in ("...", "…"):
            out.append(_norm(line))
    return out


def _commands(text: str) -> list[list[str]]:
    """The shell commands of a block, each as words (continuations joined, comments dropped)."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and re.match(r"^\w+=", words[0]):  # VAR=value before a command
            words = words[1:]
        if words:
            out.append(words)
    return out


def _command_tokens(words: list[str]) -> list[str]:
    """What a tested file must name for a command: its program, scripts, subcommand and option names."""
    program = Path(words[0]).name
    tokens = [] if program in ("bash", "sh", "python", "python3") else [program]
    after_script = False
    for word in words[1:]:
        if word.startswith("$"):
            after_script = False
            continue
        if word.startswith("--"):
            tokens.append(word.split("=")[0])
        elif re.search(r"\.(py|sh|json|yaml|yml)$", word):
            tokens.append(Path(word).name)
            after_script = word.endswith(".sh")
            continue
        elif after_script and re.fullmatch(r"[a-z][\w-]*", word):
            tokens.append(word)  # a script's subcommand (image.sh build)
        after_script = False
    return tokens


def _page_blocks_above(block: Block, kinds: tuple[str, ...]) -> list[Block]:
    return [b for b in ALL_BLOCKS[block.page] if b.line < block.line and _kind(b) in kinds]


@pytest.mark.parametrize("block", _of("text"), ids=_ids(_of("text")))
def test_a_block_that_points_at_a_tested_file_is_in_it(block):
    files = _tested_files(block)
    assert files, f"{block.where}: the marker names no file"
    texts = []
    for rel in files:
        if rel == "above":  # the blocks run earlier on this page
            ran = _page_blocks_above(block, ("launch", "python"))
            assert ran, f"{block.where}: same-as: above, but no block above it on {block.page} is run"
            texts += [b.text for b in ran]
            continue
        path = ROOT / rel
        assert path.is_file(), f"{block.where}: the marker names {rel}, which does not exist"
        assert _is_run_by_a_test(rel), f"{block.where}: {rel} is not run by any test (no test names it)"
        texts.append(path.read_text(encoding="utf-8"))
    if block.lang == "json" and all(f.endswith(".json") for f in files):
        _check_json_same_as(block, [json.loads(t) for t in texts])
        return
    haystack = "\n".join(_norm(line) for t in texts for line in t.splitlines())
    if block.lang in ("bash", "sh", "shell"):
        wanted = [t for words in _commands(block.text) for t in _command_tokens(words)]
    else:
        wanted = _code_lines(block)
    absent = [w for w in wanted if w not in haystack]
    assert not absent, f"{block.where}: not in {' '.join(files)}:\n" + "\n".join(absent)


def _subset(small: object, big: object) -> bool:
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and _subset(v, big[k]) for k, v in small.items())
    return small == big


def _check_json_same_as(block: Block, files: list[object]) -> None:
    value = _json_value(block)
    assert any(_subset(value, f) for f in files), (
        f"{block.where}: this JSON is not part of {' '.join(_tested_files(block))}"
    )


# -- json ----------------------------------------------------------------------------------------------------


def _json_value(block: Block) -> object:
    try:
        return json.loads(block.text)
    except json.JSONDecodeError:
        return json.loads("{" + block.text + "}")  # a key and its value, as "adabatch": {...}


@pytest.mark.parametrize("block", _of("json"), ids=_ids(_of("json")))
def test_json_blocks_parse_and_validate(block):
    from ds_adabatch.config.loader import load_adabatch_section, load_ds_config

    try:
        value = _json_value(block)
    except json.JSONDecodeError as e:
        pytest.fail(f"{block.where}: not JSON: {e}")
    if isinstance(value, dict) and "adabatch" in value and len(value) > 1:
        load_ds_config(value)
    elif isinstance(value, dict) and ("adabatch" in value or "schedule" in value):
        load_adabatch_section(value)


# -- bash ----------------------------------------------------------------------------------------------------


def _setup_extras() -> dict[str, list[str]]:
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no extras_require")


def _check_pip(line: str, where: str) -> None:
    words = shlex.split(line, comments=True)
    target = next(w for w in words[2:] if not w.startswith("-"))
    match = re.fullmatch(r"\.(?:\[([\w,]+)\])?", target)
    assert match, f"{where}: `{line}` installs {target!r}, not this checkout"
    extras = _setup_extras()
    for extra in (match.group(1) or "").split(",") if match.group(1) else []:
        assert extra in extras, f"{where}: setup.py has no extra {extra!r} (it has {sorted(extras)})"


def _check_curl(line: str, where: str) -> None:
    url = next(w for w in shlex.split(line, comments=True) if "://" in w)
    assert "/examples/pytorch/language-modeling/run_clm.py" in url, f"{where}: {url}"
    assert "/transformers/" in url and ("$TF" in url or "transformers.__version__" in url), (
        f"{where}: {url} must fetch the run_clm.py of the installed transformers' tag"
    )


def _without_checked_lines(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not re.match(r"\s*(pip install|curl)\s", line))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A scratch folder that sees the checkout's folders (ds_configs/, runners/, ...) by their names."""
    work = tmp_path_factory.mktemp("docs")
    for name in ("ds_configs", "runners", "scripts", "tests", "benchmarks", "docker", "ds_adabatch"):
        (work / name).symlink_to(ROOT / name)
    return work


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
    )


def _run_here(block: Block, workdir: Path) -> str:
    """Run a bash or python block in the scratch folder (once) and return what it printed."""
    if block.where in OUTPUTS:
        return OUTPUTS[block.where]
    if _kind(block) == "bash":
        for line in block.text.splitlines():
            if re.match(r"\s*pip install\s", line):
                _check_pip(line, block.where)
            elif re.match(r"\s*curl\s", line):
                _check_curl(line, block.where)
        argv = ["bash", "-c", "set -euo pipefail\n" + _without_checked_lines(block.text) + "\n"]
    else:
        path = workdir / f"{block.page.replace('/', '_')}_{block.line}.py"
        path.write_text(block.text + "\n", encoding="utf-8")
        argv = [sys.executable, str(path)]
    proc = subprocess.run(argv, cwd=workdir, env=_env(), capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{block.where} failed (exit {proc.returncode}):\n{output[-4000:]}"
    OUTPUTS[block.where] = output
    return output


OUTPUTS: dict[str, str] = {}  # where -> what the block printed, for the output blocks below it


@pytest.mark.parametrize("block", _of("bash"), ids=_ids(_of("bash")))
def test_bash_blocks_run(block, workdir):
    _run_here(block, workdir)


# -- python --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", _of("python"), ids=_ids(_of("python")))
def test_python_blocks_run(block, workdir):
    _run_here(block, workdir)


@pytest.fixture(scope="module")
def launch(workdir) -> dict[str, tuple[str, str]]:
    """Every engine and Trainer block (and the files of RUN_HERE) in one launch of 2 CPU ranks.

    Returns job id -> (status, output): status "ok", "failed" or "not reached".
    """
    jobs, first_of = [], {}
    # DeepSpeed keeps a PipelineModule's process groups in module state that a later data-parallel
    # engine would pick up: pipelines run last.
    # A Trainer ties the ds_adabatch logger to transformers' verbosity: Trainers run after the engines.
    ordered = sorted(_of("launch"), key=lambda b: ("PipelineModule" in b.text, "Trainer" in b.text))
    for block in ordered:
        if block.text in first_of:  # the same script on two pages runs once
            continue
        first_of[block.text] = block.where
        path = workdir / f"{block.page.replace('/', '_')}_{block.line}.py"
        path.write_text(block.text + "\n", encoding="utf-8")
        jobs.append({"id": block.where, "path": str(path), "argv": []})
    here = [
        {"id": " ".join([rel, *argv]), "path": str(workdir / rel), "argv": argv}
        for rel, runs in RUN_HERE.items()
        for argv in runs
    ]
    pipelines = next(
        (i for i, job in enumerate(jobs) if "PipelineModule" in Path(job["path"]).read_text()), len(jobs)
    )
    jobs[pipelines:pipelines] = here
    spec = workdir / "jobs.json"
    spec.write_text(json.dumps(jobs))
    sys.path.insert(0, str(HERE))
    from _util import torchrun

    proc = torchrun(Path(__file__), "--run-jobs", str(spec), nproc=2, cwd=workdir, timeout=900)
    log = proc.stdout + proc.stderr
    (workdir / "launch.log").write_text(log)
    results: dict[str, tuple[str, str]] = {}
    pieces = re.split(rf"^{MARK} begin (.+)$", log, flags=re.M)
    for job_id, body in zip(pieces[1::2], pieces[2::2]):
        ends = re.findall(rf"{MARK} end {re.escape(job_id)} rank \d+ (ok|failed)", body, flags=re.M)
        ok = len(ends) == 2 and set(ends) == {"ok"}
        results[job_id] = ("ok" if ok else "failed", body)
    for job in jobs:
        results.setdefault(job["id"], ("not reached", log[-3000:]))
    for text, where in first_of.items():
        for block in _of("launch"):
            if block.text == text:
                results[block.where] = results[where]
    return results


def _launched(launch: dict, job_id: str) -> str:
    status, output = launch[job_id]
    if status != "ok":
        pytest.fail(f"{job_id} {status} in the 2-rank launch:\n{output[-5000:]}")
    return output


@pytest.mark.parametrize("block", _of("launch"), ids=_ids(_of("launch")))
def test_engine_and_trainer_blocks_run_on_two_ranks(block, launch):
    OUTPUTS[block.where] = _launched(launch, block.where)


@pytest.mark.parametrize("rel", sorted(RUN_HERE))
def test_files_the_docs_show_run(rel, launch):
    for argv in RUN_HERE[rel]:
        OUTPUTS[rel] = _launched(launch, " ".join([rel, *argv]))


# -- sample output -------------------------------------------------------------------------------------------


def _pattern(line: str) -> re.Pattern[str]:
    """A documented output line as a regex: numbers, `...` and `{...}` stand for anything of their kind."""
    parts = re.split(r"(\{\.\.\.\}|\.\.\.|…)", line.strip())
    out = []
    for part in parts:
        if part in ("{...}", "...", "…"):
            out.append(".*?")
            continue
        pos = 0
        for m in NUMBER.finditer(part):
            out.append(re.escape(part[pos : m.start()]) + r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
            pos = m.end()
        out.append(re.escape(part[pos:]))
    return re.compile("".join(out))


@pytest.mark.parametrize("block", _of("output"), ids=_ids(_of("output")))
def test_sample_output_matches_a_real_run(block, request):
    source = block.marker[1]
    if source == "above":
        ran = _page_blocks_above(block, ("launch", "python", "bash"))
        assert ran, f"{block.where}: output-of: above, but nothing above it on {block.page} is run"
        producer = ran[-1].where
        if _kind(ran[-1]) == "launch":
            OUTPUTS[producer] = _launched(request.getfixturevalue("launch"), producer)
        else:
            _run_here(ran[-1], request.getfixturevalue("workdir"))
    else:
        assert source in RUN_HERE, f"{block.where}: output-of names {source}, which this test does not run"
        producer = source
        argv = RUN_HERE[source][0]
        OUTPUTS[producer] = _launched(request.getfixturevalue("launch"), " ".join([source, *argv]))
    output = OUTPUTS[producer].splitlines()
    missing = [
        line
        for line in block.text.splitlines()
        if line.strip() and not any(_pattern(line).search(o) for o in output)
    ]
    assert not missing, f"{block.where}: {producer} printed no line like:\n" + "\n".join(missing)


# -- the two commands ----------------------------------------------------------------------------------------


def test_the_main_job_script_launches_what_test_main_job_runs():
    """``bash scripts/train.sh`` (the README's first command) is the project's environment and one launch
    of runners/train_lm.py with ds_configs/lm_ramp.json, which tests/test_main_job.py runs on 2 ranks;
    ``bash scripts/test.sh`` is what CI runs (.ci/run)."""
    script = (ROOT / "scripts" / "train.sh").read_text(encoding="utf-8")
    assert 'source "$ROOT/scripts/env.sh"' in script
    launch = re.search(r"^exec python -m torch\.distributed\.run (.*?)$\n(.*?)$", script, flags=re.M)
    assert launch, "scripts/train.sh no longer ends in one torch.distributed.run launch"
    assert "runners/train_lm.py --config ds_configs/lm_ramp.json" in launch.group(2), launch.group(2)
    assert "nproc=2" in script, "the README says the main job runs on 2 ranks"
    main_job = (HERE / "test_main_job.py").read_text(encoding="utf-8")
    assert '"train_lm.py"' in main_job and '"lm_ramp.json"' in main_job
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


# -- the run_clm.py walkthrough -----------------------------------------------------------------------------

RUN_CLM_ARGUMENTS = {
    # ModelArguments and DataTrainingArguments of examples/pytorch/language-modeling/run_clm.py
    "model_name_or_path", "model_type", "config_overrides", "config_name", "tokenizer_name", "cache_dir",
    "use_fast_tokenizer", "model_revision", "token", "trust_remote_code", "dtype", "dataset_name",
    "dataset_config_name", "train_file", "validation_file", "max_train_samples", "max_eval_samples",
    "streaming", "block_size", "overwrite_cache", "validation_split_percentage",
    "preprocessing_num_workers", "keep_linebreaks",
}  # fmt: skip


def _walkthrough() -> list[Block]:
    return [b for b in ALL_BLOCKS["docs/trainer.md"] if "run_clm.py" in b.text and b.lang == "bash"]


def test_the_examples_extra_installs_what_run_clm_needs():
    extras = _setup_extras()
    assert "ds_adabatch[hf]" in extras.get("examples", []), (
        "the examples extra takes the hf extra (its ranges)"
    )
    requirements = [r for r in extras["examples"] if not r.startswith("ds_adabatch[")] + extras["hf"]
    names = {re.split(r"[<>=!~\[ ]", r)[0].lower() for r in requirements}
    # run_clm.py imports datasets, evaluate, torch and transformers; --do_eval's accuracy metric needs
    # scikit-learn; the Trainer needs accelerate.
    need = {"transformers", "accelerate", "datasets", "evaluate", "scikit-learn"}
    assert need <= names, f"setup.py's examples extra lacks {sorted(need - names)}"
    assert any('pip install -e ".[examples]"' in b.text for b in _walkthrough()), (
        "the walkthrough installs it"
    )


def test_the_walkthrough_fetches_the_run_clm_of_the_installed_transformers():
    import transformers

    text = "\n".join(b.text for b in _walkthrough())
    tag = re.search(r"^TF=(.+)$", text, flags=re.M)
    assert tag, "the walkthrough sets TF to the installed transformers' tag"
    got = subprocess.run(["bash", "-c", f"echo {tag.group(1)}"], capture_output=True, text=True, env=_env())
    assert got.stdout.strip() == f"v{transformers.__version__}", got.stdout + got.stderr


def test_the_walkthrough_runs_run_clm_with_arguments_it_and_the_trainer_take():
    from transformers import TrainingArguments

    text = "\n".join(b.text for b in _walkthrough())
    args = re.search(r'^ARGS="(.*?)"', text.replace("\\\n", " "), flags=re.M | re.S)
    assert args, "the walkthrough's ARGS line"
    flags = {w[2:] for w in args.group(1).split() if w.startswith("--")}
    known = RUN_CLM_ARGUMENTS | {f.name for f in dataclasses.fields(TrainingArguments)}
    assert flags and flags <= known, f"run_clm.py takes no {sorted(flags - known)}"
    for config in re.findall(r"\$DSAB/(ds_configs/\S+\.json)", text):
        assert (ROOT / config).is_file(), config


# -- the launch's worker ------------------------------------------------------------------------------------


def _run_jobs(spec: str) -> None:
    """Inside each of the launch's ranks: run every job in order; a failure ends the launch."""
    import runpy
    import traceback

    # One stream, in order: the job markers below and every line a job prints or logs.
    os.dup2(sys.stdout.fileno(), sys.stderr.fileno())
    import ds_adabatch

    real_finish = ds_adabatch.finish

    class Finished(BaseException):
        def __init__(self, code: int | None) -> None:
            self.code = code

    def finish(exit_code: int | None = 0) -> None:
        raise Finished(exit_code)

    ds_adabatch.finish = finish
    import ds_adabatch.runtime.distributed.comm as comm

    comm.finish = finish
    rank = int(os.environ.get("RANK", "0"))
    for job in json.loads(Path(spec).read_text()):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        if rank == 0:
            print(f"{MARK} begin {job['id']}", flush=True)
        sys.argv = [job["path"], *job["argv"]]
        status = "ok"
        try:
            runpy.run_path(job["path"], run_name="__main__")
        except Finished as done:
            status = "ok" if not done.code else "failed"
        except SystemExit as e:
            status = "ok" if not e.code else "failed"
        except BaseException:
            traceback.print_exc()
            status = "failed"
        sys.stdout.flush()
        sys.stderr.flush()
        print(f"{MARK} end {job['id']} rank {rank} {status}", flush=True)
        if status != "ok":
            os._exit(1)  # the launcher ends the other rank, which may wait in a collective
    real_finish()


if __name__ == "__main__" and sys.argv[1:2] == ["--run-jobs"]:
    _run_jobs(sys.argv[2])
