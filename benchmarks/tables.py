"""Markdown tables for the benchmark's reports: the one formatter every section's renderer
uses (:mod:`.report`, :mod:`.kv_exchange`, :mod:`.length`, :mod:`.gpu_check`), and the
record selection they share. It imports no other benchmark module, so a section can
render its own table without importing the report that collects them."""

from __future__ import annotations

from typing import Any

Record = dict[str, Any]
MiB = 2**20


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines: the header, the rule, one line per row."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def select(records: list[Record], section: str, **match: Any) -> list[Record]:
    """The records of ``section`` whose fields equal ``match``."""
    return [r for r in records if r["section"] == section and all(r.get(k) == v for k, v in match.items())]
