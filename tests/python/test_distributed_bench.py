"""The arithmetic of ``bench/distributed``'s weight-sync rounds (the benchmark itself is not a test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tomllib

from bench import distributed

MODEL_BYTES = 100_000_000
REPO = Path(__file__).resolve().parents[2]


def transport(chain_gbps: float, kept_gbps: float, seconds: float) -> dict[str, Any]:
    return {
        "model_bytes": MODEL_BYTES,
        "raw_relay_chain_bytes_per_second": chain_gbps * 1e9,
        "raw_relay_chain_kept_bytes_per_second": kept_gbps * 1e9,
        "raw_relay_chain_bucketed_bytes_per_second": kept_gbps / 2 * 1e9,
        "seconds_median": seconds,
        "while_filling_seconds_median": seconds * 1.25,
        "while_filling_fraction_of_raw_relay_chain": 0.64,
        "in_place_seconds_median": seconds * 1.1,
        "in_place_fraction_of_raw_relay_chain": 0.72,
        "fraction_of_loopback": 0.5,
        "fraction_of_raw_relay_chain": 0.8,
        "trainer_egress_per_model_bytes": 1.0,
    }


def measurement(workers: int, before: float, after: float, sync_seconds: float) -> dict[str, Any]:
    return {
        "workers": workers,
        "transport": [transport(before, before / 2, 0.04), transport(after, after / 2, 0.06)],
        "end_to_end": {"seconds_median": sync_seconds},
    }


def test_a_sync_is_divided_by_the_raw_chain_measured_around_it() -> None:
    # The chain moved the model in 0.05 s before the launch and 0.03 s after: 0.04 s on average.
    m = measurement(1, before=2.0, after=100 / 30, sync_seconds=0.08)
    assert distributed.fraction_of_raw_chain(m) == pytest.approx(0.5)
    assert distributed.fraction_of_raw_chain(m, rate=distributed.KEPT_CHAIN) == pytest.approx(1.0)
    fractions = distributed.with_fractions(m)
    assert fractions["fraction_of_raw_chain_kept"] == pytest.approx(1.0)
    assert fractions["fraction_of_raw_chain_bucketed"] == pytest.approx(2.0)


def test_headline_figures_are_medians_over_each_worker_counts_rounds() -> None:
    measured = [
        distributed.with_fractions(measurement(workers, before=2.0, after=2.0, sync_seconds=seconds))
        for workers in distributed.WORKER_COUNTS
        for seconds in (0.05, 0.1, 0.2)
    ]
    results = distributed.sync_results(measured)
    # 0.05 s of raw chain against syncs of 0.05, 0.1 and 0.2 s: fractions 1, 0.5 and 0.25.
    assert results["weight_sync_end_to_end_fraction_of_raw_chain"] == {"1": 0.5, "2": 0.5, "4": 0.5}
    assert results["weight_sync_seconds"] == {"1": 0.1, "2": 0.1, "4": 0.1}
    assert results["weight_sync_transport_seconds"]["4"] == pytest.approx(0.05)
    assert results["weight_sync_transport_while_filling_seconds"]["4"] == pytest.approx(0.0625)
    assert results["weight_sync_transport_while_filling_fraction_of_raw_chain"]["1"] == pytest.approx(0.64)
    assert results["weight_sync_transport_in_place_seconds"]["2"] == pytest.approx(0.055)
    assert results["weight_sync_transport_in_place_fraction_of_raw_chain"]["4"] == pytest.approx(0.72)
    assert [m["fraction_of_raw_chain"] for m in measured[:3]] == pytest.approx([1.0, 0.5, 0.25])


def test_the_shipped_settings_sync_is_its_pull_against_the_raw_chain_around_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    chains = iter([2.0, 100 / 30])  # 0.05 s, then 0.03 s for the model: 0.04 s on average
    launched: list[dict[str, Any]] = []

    def fake_transport(binary: Path, layout: Path, workers: int, repeats: int) -> dict[str, Any]:
        return transport(next(chains), 1.0, 0.05)

    def fake_launch(*args: Any) -> dict[str, Any]:
        launched.append({"workers": args[3], "cluster": args[6]})
        return {"seconds_median": 0.01, "span_seconds_median": {"weights.pull": 0.05}}

    monkeypatch.setattr(distributed, "weight_sync_transport", fake_transport)
    monkeypatch.setattr(distributed, "weight_sync_end_to_end", fake_launch)
    bench = distributed.SyncBench(tmp_path, tmp_path, tmp_path, tmp_path, tmp_path, repeats=1, steps=3)
    shipped = bench.shipped()
    shipped_cluster = tomllib.loads((REPO / "configs" / "distributed.toml").read_text())["cluster"]
    assert launched == [{"workers": shipped_cluster["workers"], "cluster": shipped_cluster}]
    assert shipped["pull_fraction_of_raw_chain"] == pytest.approx(0.8)


def test_a_part_rerun_on_another_host_keeps_that_hosts_figures() -> None:
    intel = {"cpu_model": "Intel Xeon", "date": "2026-12-06"}
    amd = {"cpu_model": "AMD EPYC", "date": "2026-12-07"}
    results: dict[str, Any] = {}
    distributed.record_part(
        results, "tail", {"step_seconds_p99_over_median": 1.4}, {"step_time_tail": 1}, intel
    )
    distributed.record_part(results, "sync", {"weight_sync_seconds": {"1": 0.07}}, {}, intel)
    assert "other_hosts" not in results
    distributed.record_part(
        results, "tail", {"step_seconds_p99_over_median": 1.2}, {"step_time_tail": 2}, amd
    )
    assert results["step_seconds_p99_over_median"] == 1.2
    assert results["details"] == {"step_time_tail": 2}
    assert results["parts"] == {"tail": amd, "sync": intel}
    # Only the rerun part's figures move, under the host and date that measured them.
    assert results["other_hosts"] == {
        "Intel Xeon": {"tail": {"date": "2026-12-06", "step_seconds_p99_over_median": 1.4}}
    }
    distributed.record_part(results, "tail", {"step_seconds_p99_over_median": 1.3}, {}, amd)
    assert results["other_hosts"]["Intel Xeon"]["tail"]["step_seconds_p99_over_median"] == 1.4
    # Back on Intel: the AMD figures become the other host's and Intel's old entry goes.
    distributed.record_part(results, "tail", {"step_seconds_p99_over_median": 1.5}, {}, intel)
    assert results["step_seconds_p99_over_median"] == 1.5
    assert results["other_hosts"] == {
        "AMD EPYC": {"tail": {"date": "2026-12-07", "step_seconds_p99_over_median": 1.3}}
    }
