"""The package's import graph: no cycle inside ``integrations`` or ``schedules``, old imports still work.

The graph is read from the source with ``ast``, so it holds every import, wherever it is written: at module
level, under ``if TYPE_CHECKING:``, or inside a function. ``from . import x`` is an edge to the module ``x``
when ``x`` is a submodule, else to the package it names.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PACKAGE = "ds_adabatch"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module under ``root`` (the folder of ``package``) by its dotted name."""
    names: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _known_prefix(name: str, modules: dict[str, Path]) -> str | None:
    """The longest module of the package that ``name`` is or lies inside (``pkg.mod.func`` -> ``pkg.mod``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imported(node: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The package's modules one import statement names."""
    found: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            target = _known_prefix(alias.name, modules)
            if target is not None:
                found.add(target)
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            here = module.split(".") if is_package else module.split(".")[:-1]
            if node.level > 1:
                here = here[: -(node.level - 1)]
            base = ".".join([*here, node.module] if node.module else here)
        else:
            base = node.module or ""
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            target = submodule if submodule in modules else _known_prefix(base, modules)
            if target is not None:
                found.add(target)
    return found


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``, function-level and ``TYPE_CHECKING`` imports included."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(tree):
            edges |= _imported(node, name, is_package, modules)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]], inside: str) -> list[str] | None:
    """One import cycle among the modules ``inside`` (a dotted package: itself and everything below it),
    as ``[a, b, ..., a]``; None when there is none."""

    def within(name: str) -> bool:
        return name == inside or name.startswith(inside + ".")

    nodes = sorted(n for n in graph if within(n))
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if not within(nxt):
                continue
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in nodes:
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


@pytest.mark.parametrize(
    "inside", [PACKAGE, f"{PACKAGE}.integrations", f"{PACKAGE}.runtime", f"{PACKAGE}.schedules"]
)
def test_no_import_cycle(inside):
    graph = import_graph()
    assert any(n.startswith(inside) for n in graph), f"no module found under {inside}"
    cycle = find_cycle(graph, inside)
    assert cycle is None, f"import cycle in {inside}: " + " -> ".join(cycle or [])


# The layers of the package, lowest first: a module imports only from its own layer or a lower one. The
# package's ``__init__`` (the public facade, every name imported lazily) stands above them all.
PACKAGE_LAYERS = [
    "_version",
    "checkpoint_manifest",
    "plan",
    "config",
    "signals",
    "schedules",
    "data",
    "runtime",
    "integrations",
    "launch",
    "cli",
    "testing",
]
# The runtime's capabilities, lowest first (docs/architecture.md draws the same picture): the door to
# DeepSpeed's private names, process groups, memory, the noise scale, the step core, checkpoints, the
# engines, the pipeline engine, live elasticity, and ``initialize`` that wires them.
RUNTIME_LAYERS = [
    "deepspeed_internals",
    "distributed",
    "memory",
    "noise",
    "core",
    "checkpoint",
    "engine",
    "pipeline",
    "live",
    "initialize",
]


def _layer(module: str, under: str, layers: list[str]) -> int | None:
    if not module.startswith(under + "."):
        return None
    head = module[len(under) + 1 :].split(".")[0]
    assert head in layers, f"{under}.{head} is in no layer: add it to the list of layers in this test"
    return layers.index(head)


def upward_imports(graph: dict[str, set[str]], under: str, layers: list[str]) -> list[str]:
    """``"a -> b"`` for every import of ``graph`` from a layer of ``under`` to a higher one."""
    upward = []
    for module, edges in sorted(graph.items()):
        mine = _layer(module, under, layers)
        if mine is None:
            continue
        for target in sorted(edges):
            theirs = _layer(target, under, layers)
            if theirs is not None and theirs > mine:
                upward.append(f"{module} -> {target}")
    return upward


@pytest.mark.parametrize(
    ("under", "layers"), [(PACKAGE, PACKAGE_LAYERS), (f"{PACKAGE}.runtime", RUNTIME_LAYERS)]
)
def test_every_layer_imports_only_downward(under, layers):
    upward = upward_imports(import_graph(), under, layers)
    assert upward == [], "imports up the layers:\n" + "\n".join(upward)


def test_the_runtime_is_its_capabilities():
    # Every runtime module lives in the sub-package of its capability; only the door stands alone.
    flat = sorted(p.name for p in (ROOT / "runtime").glob("*.py") if p.name != "__init__.py")
    assert flat == ["deepspeed_internals.py"], flat
    folders = sorted(p.name for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(RUNTIME_LAYERS[1:]), folders


def test_a_layer_that_imports_upward_is_found(tmp_path):
    root = tmp_path / "pkg"
    _write(
        root,
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/a.py": "def f():\n    from ..high import b\n",
            "high/__init__.py": "",
            "high/b.py": "from ..low.a import f\n",
        },
    )
    graph = import_graph(root, "pkg")
    assert upward_imports(graph, "pkg", ["low", "high"]) == ["pkg.low.a -> pkg.high.b"]
    assert upward_imports(graph, "pkg", ["high", "low"]) == ["pkg.high.b -> pkg.low.a"]
    with pytest.raises(AssertionError, match="pkg.low is in no layer"):
        upward_imports(graph, "pkg", ["high"])


def test_the_schedule_base_imports_no_schedule():
    graph = import_graph()
    rules = {f"{PACKAGE}.schedules.{m}" for m in ("noise", "plateau", "ramps", "seesaw", "user", "registry")}
    assert not graph[f"{PACKAGE}.schedules.base"] & rules, graph[f"{PACKAGE}.schedules.base"]


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_graph_sees_every_kind_of_import_that_closes_a_cycle(tmp_path):
    # The shapes the package had before it was split: an import back under TYPE_CHECKING, one inside a
    # function, and a relative ``from . import module``.
    root = tmp_path / "pkg"
    _write(
        root,
        {
            "__init__.py": "",
            "a/__init__.py": "from . import front\n",
            "a/front.py": "from ._helper import Helper\n",
            "a/_helper.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .front import Thing\n"
            ),
            "b/__init__.py": "",
            "b/base.py": "def build():\n    from .rule import Rule\n",
            "b/rule.py": "from pkg.b.base import build\n",
            "c/__init__.py": "",
            "c/one.py": "from . import two\n",
            "c/two.py": "from .. import c\nfrom ..c import one\n",
            "d/__init__.py": "from .x import f\n",
            "d/x.py": "import pkg.d.y\n",
            "d/y.py": "import os\nimport pkg\n",
        },
    )
    graph = import_graph(root, "pkg")
    assert graph["pkg.a"] == {"pkg.a.front"}
    assert find_cycle(graph, "pkg.a") == ["pkg.a.front", "pkg.a._helper", "pkg.a.front"]
    assert find_cycle(graph, "pkg.b") == ["pkg.b.base", "pkg.b.rule", "pkg.b.base"]
    assert graph["pkg.c.two"] == {"pkg.c", "pkg.c.one"}
    assert find_cycle(graph, "pkg.c") == ["pkg.c.one", "pkg.c.two", "pkg.c.one"]
    assert graph["pkg.d.y"] == {"pkg"}
    assert find_cycle(graph, "pkg.d") is None


def test_the_imports_users_have_still_work():
    pytest.importorskip("transformers")
    code = textwrap.dedent(
        """
        import sys
        import ds_adabatch, ds_adabatch.integrations, ds_adabatch.integrations.hf
        import ds_adabatch.integrations.hf.config, ds_adabatch.integrations.hf.lengths
        assert "transformers" not in sys.modules, "importing the packages imported transformers"

        from ds_adabatch.integrations import AdaptiveBatchSizeTrainer, AdaptiveBatchState
        from ds_adabatch.integrations import transformers as old
        from ds_adabatch.integrations import hf
        from ds_adabatch.integrations.hf import prepare

        for name in ("STATE_FILE", "AdaptiveBatchSizeTrainer", "AdaptiveBatchState", "BatchSizeScheduler"):
            assert getattr(old, name) is getattr(hf, name), name
        assert set(old.__all__) == set(hf.__all__)
        assert old.AdaptiveBatchSizeTrainer is AdaptiveBatchSizeTrainer
        assert old.AdaptiveBatchState is AdaptiveBatchState
        assert set(ds_adabatch.integrations.__all__) <= set(hf.__all__)

        # The stand-in schedule of batch_size_scheduler= is named by import path: it must resolve.
        from ds_adabatch.integrations.hf.config import FUNCTION_PLACEHOLDER
        from ds_adabatch.schedules.user import resolve_function
        assert resolve_function(FUNCTION_PLACEHOLDER) is prepare.keep_batch_size

        import ds_adabatch.schedules as schedules
        for name in schedules.__all__:
            assert getattr(schedules, name) is not None, name
        from ds_adabatch.schedules.registry import build_schedule
        assert schedules.build_schedule is build_schedule
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_no_production_module_imports_the_testing_helpers():
    # The simulated memory (ds_adabatch.testing) is passed in through runtime/memory/stand_ins.py: the runtime
    # reads whatever stands in for the accelerator, never the test helpers themselves.
    graph = import_graph()
    testing = f"{PACKAGE}.testing"
    importers = sorted(m for m, edges in graph.items() if testing in edges and m != testing)
    assert importers == [], f"production modules import {testing}: {importers}"


def test_the_architecture_page_lists_the_runtime_layers_in_order():
    # docs/architecture.md's table of runtime/ names every capability, lowest first, as RUNTIME_LAYERS does.
    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    section = page.split("## `runtime/` by capability", 1)
    assert len(section) == 2, "docs/architecture.md has no section '`runtime/` by capability'"
    rows = [line for line in section[1].splitlines() if line.startswith("| `")]
    listed = [row.split("`")[1].removesuffix("/").removesuffix(".py") for row in rows]
    assert listed == RUNTIME_LAYERS, f"the page lists {listed}, the import-graph test {RUNTIME_LAYERS}"
