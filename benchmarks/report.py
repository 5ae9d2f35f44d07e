"""The benchmark output contract (docs/benchmarks.md).

One JSON object on stdout: ``bench``, ``lmkv_version``, ``params`` and
``metrics``; each metric has ``value``, ``unit``, ``baseline``,
``baseline_what`` and ``ratio = value / baseline`` (null without a baseline).
Baselines are measured in the same run, on the same bytes, never constants.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any


def lmkv_version() -> str:
    try:
        return version("lmkv")
    except PackageNotFoundError:
        return "0.0.0+source"


@dataclass
class Metric:
    """One figure of a bench, beside the baseline measured in the same run (and their ratio)."""

    value: float
    unit: str
    baseline: float | None = None
    baseline_what: str | None = None

    @property
    def ratio(self) -> float | None:
        if self.baseline in (None, 0):
            return None
        return self.value / self.baseline

    def to_dict(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "unit": self.unit,
            "baseline": self.baseline,
            "baseline_what": self.baseline_what,
            "ratio": self.ratio,
        }


@dataclass
class Report:
    """A bench's figures and parameters, printed as text or as one JSON object (``--json``)."""

    bench: str
    params: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Metric] = field(default_factory=dict)

    def add(self, name: str, value: float, unit: str, baseline: float | None = None,
            baseline_what: str | None = None) -> None:
        self.metrics[name] = Metric(value, unit, baseline, baseline_what)

    def to_dict(self) -> dict[str, Any]:
        return {
            "bench": self.bench,
            "lmkv_version": lmkv_version(),
            "params": self.params,
            "metrics": {k: m.to_dict() for k, m in self.metrics.items()},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def print_table(self) -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"lmkv bench {self.bench}")
        for col in ("metric", "value", "unit", "baseline", "ratio", "baseline is"):
            table.add_column(col)
        for name, m in self.metrics.items():
            table.add_row(
                name, f"{m.value:.4g}", m.unit,
                "" if m.baseline is None else f"{m.baseline:.4g}",
                "" if m.ratio is None else f"{m.ratio:.2f}x",
                m.baseline_what or "",
            )
        console = Console()
        console.print(table)
        console.print(f"params: {json.dumps(self.params)}")


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def interleaved(rounds: int, *fns: Callable[[], float]) -> list[float]:
    """Run each timing function once per round, alternating, and return each one's median.

    Alternating the measured path and its baseline within a round keeps a noisy
    machine's drift from favouring either.
    """
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for s, fn in zip(samples, fns):
            s.append(fn())
    return [statistics.median(s) for s in samples]


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
