"""Plans and integer lists as text, for ``ds-adabatch`` and logs: ``"1-8,12,16"`` and back, a table, a
plan's per-rank micro-batch sizes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .solver import BatchPlan

__all__ = ["format_int_ranges", "format_plan", "keys_text", "parse_int_ranges", "runs", "table"]

_MAX_STEP_COLUMNS = 12  # wider plans print each rank's sizes as runs ("4 x10, 3 x6")


def parse_int_ranges(spec: str) -> list[int]:
    """``"1-8,12,16"`` -> ``[1, ..., 8, 12, 16]`` (sorted, without duplicates, every value >= 1).

    Raises:
        ValueError: the text is not a comma list of integers and ``a-b`` ranges with ``1 <= a <= b``.
    """
    values: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise ValueError(f"empty entry in {spec!r}")
        low_text, sep, high_text = part.partition("-")
        try:
            low = int(low_text)
            high = int(high_text) if sep else low
        except ValueError:
            raise ValueError(f"{part!r} is not an integer or a range like 1-8") from None
        if low < 1 or high < low:
            raise ValueError(f"{part!r} must be integers >= 1 with the smaller one first, e.g. 1-8")
        values.update(range(low, high + 1))
    return sorted(values)


def format_int_ranges(values: Sequence[int]) -> str:
    """``[1, 2, 3, 5, 8, 9]`` -> ``"1-3,5,8,9"`` (the inverse of :func:`parse_int_ranges`)."""
    out: list[str] = []
    ordered = sorted(set(values))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if j - i < 2 else f"{ordered[i]}-{ordered[j]}")
        if j - i == 1:
            out.append(str(ordered[j]))
        i = j + 1
    return ",".join(out)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell; the first column left-aligned, the others right-aligned."""
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def runs(sizes: Sequence[int]) -> str:
    """``(4, 4, 4, 3)`` -> ``"4 x3, 3 x1"``."""
    out: list[str] = []
    i = 0
    while i < len(sizes):
        j = i
        while j < len(sizes) and sizes[j] == sizes[i]:
            j += 1
        out.append(f"{sizes[i]} x{j - i}")
        i = j
    return ", ".join(out)


def keys_text(plan: BatchPlan) -> str:
    """DeepSpeed's three batch keys of ``plan`` as ``key=value`` words."""
    return " ".join(f"{k}={v}" for k, v in plan.deepspeed_batch_keys().items())


def format_plan(plan: BatchPlan) -> str:
    """A per-rank table of ``plan`` (consecutive ranks with equal sizes share a row) and a summary."""
    groups: list[tuple[int, int, tuple[int, ...]]] = []
    for rank in range(plan.world_size):
        sizes = plan.micro_batch_sizes(rank)
        if groups and groups[-1][2] == sizes:
            groups[-1] = (groups[-1][0], rank, sizes)
        else:
            groups.append((rank, rank, sizes))
    gas = plan.gradient_accumulation_steps
    wide = gas > _MAX_STEP_COLUMNS
    headers = [
        "rank",
        *(["micro-batch sizes per accumulation step"] if wide else [f"step {s}" for s in range(gas)]),
    ]
    headers.append("samples per rank")
    rows = []
    for first, last, sizes in groups:
        ranks = str(first) if first == last else f"{first}-{last}"
        rows.append([ranks, *([runs(sizes)] if wide else sizes), sum(sizes)])
    empty = sum(sizes.count(0) * (last - first + 1) for first, last, sizes in groups)
    summary = f"{plan.describe()}; DeepSpeed keys: {keys_text(plan)}"
    if empty:
        summary += f"; {empty} empty slot{'s' if empty != 1 else ''} (run as zero-weight pads)"
    return f"{table(headers, rows)}\n\n{summary}"
