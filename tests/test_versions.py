"""setup.py's torch range is what CI runs: each minor release it accepts has one release that CI tests
(the whole suite on the one scripts/env.sh installs, the focused suite on scripts/test_torch_matrix.sh's),
and docs/versions.md lists each."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _read(rel: str) -> str:
    return (ROOT / rel).read_text(encoding="utf-8")


def _accepted_minors() -> list[tuple[int, int]]:
    found = re.search(r'"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"', _read("setup.py"))
    assert found, "setup.py states torch as >=X.Y,<X.Z"
    major, low, cap_major, cap = (int(g) for g in found.groups())
    assert cap_major == major, "the torch range stays within one major release"
    return [(major, minor) for minor in range(low, cap)]


def _whole_suite_release() -> str:
    found = re.search(r'pip install --quiet "torch==([\d.]+)"', _read("scripts/env.sh"))
    assert found, "scripts/env.sh installs one torch release"
    return found.group(1)


def _matrix_releases() -> list[str]:
    found = re.search(r"^DEFAULT_VERSIONS=\(([^)]*)\)", _read("scripts/test_torch_matrix.sh"), re.M)
    assert found, "scripts/test_torch_matrix.sh names its releases in DEFAULT_VERSIONS"
    return found.group(1).split()


def _minor(release: str) -> tuple[int, int]:
    major, minor = release.split(".")[:2]
    return int(major), int(minor)


def test_every_minor_release_setup_py_accepts_is_run_by_ci():
    tested = [_whole_suite_release(), *_matrix_releases()]
    assert sorted(_minor(r) for r in tested) == _accepted_minors(), (
        f"setup.py accepts torch {_accepted_minors()}, CI runs {tested}: widen or narrow them together"
    )
    ci = _read(".ci/run")
    assert re.search(r"^bash scripts/test_torch_matrix\.sh( [>&].*)?$", ci, re.M), (
        ".ci/run runs scripts/test_torch_matrix.sh on its releases"
    )


def test_the_versions_page_lists_each_release_ci_runs():
    page = _read("docs/versions.md")
    for release in [_whole_suite_release(), *_matrix_releases()]:
        assert re.search(rf"^\| {re.escape(release)} \|", page, re.M), f"docs/versions.md lists no {release}"
