"""One error type for every configuration problem, listing all of them at once."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ConfigError", "ConfigProblem"]

_MISSING = object()


@dataclass(frozen=True)
class ConfigProblem:
    """One problem: where (dotted path), what was there, and what would be valid."""

    path: str
    message: str
    value: object = _MISSING

    def __str__(self) -> str:
        shown = "" if self.value is _MISSING else f" (got {self.value!r})"
        return f"{self.path or '<root>'}: {self.message}{shown}"


class ConfigError(ValueError):
    """A ds_config / ``"adabatch"`` section is invalid. ``problems`` lists every problem found."""

    def __init__(self, problems: Iterable[ConfigProblem], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        n = len(self.problems)
        lines = [f"{n} problem{'s' if n != 1 else ''}{where}:"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))

    @classmethod
    def single(cls, path: str, message: str, value: object = _MISSING, source: str | None = None):
        return cls([ConfigProblem(path, message, value)], source)

    @property
    def paths(self) -> list[str]:
        return [p.path for p in self.problems]
