"""Tables of MLflow runs: one row per run, columns read from its id, tags, params, status or metrics.

Shared by the compare report (:mod:`framework.driver.compare`) and its recovery table
(:mod:`framework.driver.faults.report`). A column is ``(name, source kind, key, format)``: kind ``id``
(the first 8 characters of the run id; key unused), ``tag``, ``param``, ``status`` (the MLflow
run status; key unused) or ``metric``; ``format`` is a ``format()`` spec for the printed table.
"""

from __future__ import annotations

import math
from typing import Any

Column = tuple[str, str, str, str]  # (name, source kind, key, format spec)


def row_of(run: Any, columns: list[Column]) -> dict[str, Any]:
    """One table row of MLflow ``run``: column name -> value (None where the run did not record it)."""
    row: dict[str, Any] = {}
    for col, kind, key, _ in columns:
        if kind == "id":
            row[col] = run.info.run_id[:8]
        elif kind == "tag":
            row[col] = run.data.tags.get(key)
        elif kind == "param":
            row[col] = run.data.params.get(key)
        elif kind == "status":
            row[col] = run.info.status
        else:
            row[col] = run.data.metrics.get(key)
    return row


def format_table(rows: list[dict[str, Any]], columns: list[Column], text_columns: int = 1) -> str:
    """Fixed-width text table; ``n/a`` where a value is missing or NaN; the first ``text_columns`` left-aligned."""
    cells = [[c for c, *_ in columns]]
    for row in rows:
        line = []
        for col, _, _, spec in columns:
            v = row[col]
            line.append("n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec))
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(c.rjust(w) if i >= text_columns else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in cells
    )
