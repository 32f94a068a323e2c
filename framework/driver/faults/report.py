"""The recovery table of the compare report (``python -m framework.compare``).

Printed (and written as ``compare_recovery.csv``, appended to ``compare.md``) when at least one
run of the experiment had faults, a resilience policy or a recovery (every run logs the figures,
most of them zero): one row per such run with the fault kinds it injected and its resilience
policy next to ``fault/*``, ``recovery/*``, ``goodput`` and the lost and restart seconds (see
:mod:`framework.driver.faults.accounting` for their definitions).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from framework.base.tables import Column, format_table, row_of

# (column, source kind, key, format): see framework.base.tables
RECOVERY_COLUMNS: list[Column] = [
    ("run", "id", "", "s"),
    ("faults", "tag", "fault.kinds", "s"),
    ("resilience", "tag", "resilience.policy", "s"),
    ("status", "status", "", "s"),
    ("injected", "metric", "fault/injected", ".0f"),
    ("detected", "metric", "fault/detected", ".0f"),
    ("detect_latency_steps", "metric", "fault/detect_latency_steps", ".1f"),
    ("restarts", "metric", "recovery/restarts", ".0f"),
    ("rollbacks", "metric", "recovery/rollbacks", ".0f"),
    ("skipped_steps", "metric", "recovery/skipped_steps", ".0f"),
    ("recomputed_steps", "metric", "recovery/recomputed_steps", ".0f"),
    ("recovery_time_s", "metric", "recovery/time_s", ".2f"),
    ("goodput", "metric", "goodput", ".3f"),
    ("lost_s", "metric", "goodput/lost_s", ".2f"),
    ("restart_s", "metric", "goodput/restart_s", ".2f"),
    ("final_loss", "metric", "train/loss_final", ".4f"),
]


RECOVERY_EVIDENCE = (
    "fault/injected",
    "fault/detected",
    "recovery/restarts",
    "recovery/rollbacks",
    "recovery/skipped_steps",
)


def recovery_rows(runs: list[Any]) -> list[dict[str, Any]]:
    """One row per run with a resilience policy tag or a non-zero fault/recovery count (an empty list when none)."""

    def has_recovery(run: Any) -> bool:
        m = run.data.metrics
        return "resilience.policy" in run.data.tags or any(m.get(k, 0.0) > 0 for k in RECOVERY_EVIDENCE)

    return [row_of(run, RECOVERY_COLUMNS) for run in runs if has_recovery(run)]


def format_recovery_table(rows: list[dict[str, Any]]) -> str:
    """Fixed-width text table; ``n/a`` where a value is missing."""
    return format_table(rows, RECOVERY_COLUMNS, text_columns=4)


def write_recovery(rows: list[dict[str, Any]], table: str, out: Path) -> list[Path]:
    """``compare_recovery.csv`` in ``out``; the table is appended to ``compare.md``. Returns the CSV path."""
    path = out / "compare_recovery.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[c for c, *_ in RECOVERY_COLUMNS])
        writer.writeheader()
        writer.writerows(rows)
    with open(out / "compare.md", "a") as f:
        f.write("\nRecovery (framework/faults)\n```\n" + table + "\n```\n")
    return [path]
