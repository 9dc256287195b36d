"""Headline figures of other hosts, carried from a benchmark's results file into its next run,
so that a run on one kind of host does not drop what was measured on another."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

Results = Mapping[str, Any]


def carry_other_hosts(
    previous: Results | None,
    host: str,
    host_of: Callable[[Results], str],
    summary_of: Callable[[Results], dict[str, Any]],
) -> dict[str, Any]:
    """The latest figures of every host but `host`: those `previous` (the results file before
    this run, or None) carried, and `previous`'s own (`summary_of`) if `host_of` it differs."""
    if previous is None:
        return {}
    hosts = {name: summary for name, summary in previous.get("other_hosts", {}).items() if name != host}
    if host_of(previous) != host:
        hosts[host_of(previous)] = summary_of(previous)
    return hosts
