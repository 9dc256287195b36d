"""Figures of other hosts carried from one benchmark run to the next (bench/hosts.py)."""

from __future__ import annotations

from bench.hosts import carry_other_hosts


def _results(cpu: str, figure: float, other_hosts: dict | None = None) -> dict:
    return {"cpu": cpu, "figure": figure, "other_hosts": other_hosts or {}}


def _carry(previous: dict | None, host: str) -> dict:
    return carry_other_hosts(previous, host, lambda r: r["cpu"], lambda r: {"figure": r["figure"]})


def test_a_first_run_has_no_other_hosts():
    assert _carry(None, "Intel") == {}


def test_a_run_on_another_host_keeps_the_previous_hosts_figures():
    assert _carry(_results("AMD", 0.46), "Intel") == {"AMD": {"figure": 0.46}}


def test_a_run_on_the_same_host_replaces_its_own_and_keeps_the_others():
    previous = _results("Intel", 0.34, {"AMD": {"figure": 0.46}})
    assert _carry(previous, "Intel") == {"AMD": {"figure": 0.46}}
    # Back on AMD: the Intel run becomes the other host and AMD's old entry is dropped.
    assert _carry(previous, "AMD") == {"Intel": {"figure": 0.34}}
