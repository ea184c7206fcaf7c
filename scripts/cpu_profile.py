"""What each test module cost a run of the suite, from the records of ``TEST_CPU_PROFILE=DIR``
(tests/conftest.py): ``python scripts/cpu_profile.py DIR [--top N]``.

Prints the total, then one line per module, the costliest first: CPU seconds (the pytest worker's own and
those of the processes it launched and waited for), wall seconds, tests run; then the N costliest single
phases (a module's launches are usually one fixture's setup). Processes that nobody waited for (a
container's, a daemon's) are not counted: compare the total with the run's own CPU time (``/usr/bin/time``)
to see how much that is.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load(folder: Path) -> list[dict]:
    """Every record of every worker in ``folder``."""
    files = sorted(folder.glob("cpu-*.jsonl"))
    if not files:
        raise SystemExit(f"no cpu-*.jsonl in {folder}: run the suite with TEST_CPU_PROFILE={folder}")
    return [json.loads(line) for path in files for line in path.read_text().splitlines() if line.strip()]


def per_module(records: list[dict]) -> dict[str, dict[str, float]]:
    """Module path -> {"cpu_s", "wall_s", "tests"} (tests: the number of test calls)."""
    modules: dict[str, dict[str, float]] = defaultdict(lambda: {"cpu_s": 0.0, "wall_s": 0.0, "tests": 0})
    for r in records:
        m = modules[r["test"].split("::")[0]]
        m["cpu_s"] += r["own_cpu_s"] + r["launched_cpu_s"]
        m["wall_s"] += r["wall_s"]
        m["tests"] += r["phase"] == "call"
    return dict(modules)


def report(records: list[dict], top: int) -> str:
    modules = per_module(records)
    cpu = sum(m["cpu_s"] for m in modules.values())
    wall = sum(m["wall_s"] for m in modules.values())
    lines = [f"total: {cpu:.0f} CPU s, {wall:.0f} s of test time, {len(records)} phases"]
    lines += [f"{'CPU s':>8} {'wall s':>8} {'tests':>6}  module"]
    for name, m in sorted(modules.items(), key=lambda kv: -kv[1]["cpu_s"]):
        lines.append(f"{m['cpu_s']:8.0f} {m['wall_s']:8.0f} {m['tests']:6d}  {name}")
    lines += ["", f"the {top} costliest phases:"]
    for r in sorted(records, key=lambda r: -(r["own_cpu_s"] + r["launched_cpu_s"]))[:top]:
        lines.append(
            f"{r['own_cpu_s'] + r['launched_cpu_s']:8.0f} {r['wall_s']:8.0f}  {r['phase']:8s} {r['test']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="the folder TEST_CPU_PROFILE named")
    p.add_argument("--top", type=int, default=20, help="how many single phases to list (default 20)")
    args = p.parse_args(argv)
    print(report(load(args.folder), args.top))


if __name__ == "__main__":
    main()
