"""``bench/sync_cpu``'s attribution of a system-wide profile to a launch's weight syncs (the
profile itself is a benchmark, not a test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import sync_cpu
from bench.sync_cpu import Sample

CONTROLLER, TRAINER, WORKER = 100, 200, 300


def test_samples_are_read_with_and_without_call_stacks() -> None:
    flat = [
        "         rollout   200/201   1765000000.100000:  ffffffff8123abcd _copy_from_iter",
        "         swapper     0/0     1765000000.100500:  ffffffff81000000 default_idle",
        "a line perf prints that is no sample",
    ]
    stacked = [
        "    tokio-worker   300/305   1765000000.200000: ",
        "\t    5612ab34cd XXH3_hashLong_64b_internal (/work/rollout)",
        "\t    5612ab0000 rollout_net::store::pull (/work/rollout)",
        "",
    ]
    samples = sync_cpu.parse_samples(flat + stacked)
    assert [(s.comm, s.pid, s.function) for s in samples] == [
        ("rollout", 200, "_copy_from_iter"),
        ("swapper", 0, "default_idle"),
        # Only the innermost frame of a stack names the sample.
        ("tokio-worker", 300, "XXH3_hashLong_64b_internal (/work/rollout)"),
    ]
    assert samples[0].seconds == pytest.approx(1765000000.1)


def trace_event(pid: int, name: str, phase: str, seconds: float) -> dict[str, Any]:
    return {"pid": pid, "name": name, "ph": phase, "ts": seconds * 1e6, "id": 1}


def trace(syncs: int) -> dict[str, Any]:
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
        for pid, name in ((CONTROLLER, "controller"), (TRAINER, "trainer-0"), (WORKER, "worker-0"))
    ]
    for sync in range(syncs):
        start = 10.0 * sync
        events.append(trace_event(CONTROLLER, "weights.publish", "b", start))
        # A worker's own spans do not bound a sync: only the controller's do.
        events.append(trace_event(WORKER, "weights.load", "e", start + 0.5))
        events.append(trace_event(CONTROLLER, "weights.load", "e", start + 1.0))
    return {"traceEvents": events}


def test_a_sync_runs_from_the_controllers_publish_to_its_load_and_the_first_are_left_out() -> None:
    windows, names = sync_cpu.sync_windows(trace(syncs=sync_cpu.SYNCS_LEFT_OUT + 2))
    first = 10.0 * sync_cpu.SYNCS_LEFT_OUT
    assert windows == [(first, first + 1.0), (first + 10.0, first + 11.0)]
    assert names == {CONTROLLER: "controller", TRAINER: "trainer-0", WORKER: "worker-0"}


def test_work_is_told_apart_by_its_function() -> None:
    assert sync_cpu.work_kind("_copy_to_iter") == "kernel socket copies"
    assert sync_cpu.work_kind("XXH3_hashLong_64b_internal") == "XXH3 hashing"
    assert sync_cpu.work_kind("__memmove_avx_unaligned_erms") == "memory copies in user space"
    assert sync_cpu.work_kind("try_to_wake_up") == "wakeups and interrupts"
    assert sync_cpu.work_kind("at::native::add_kernel") == "other"


def test_cpu_inside_the_syncs_is_attributed_by_process_and_work() -> None:
    rate, cores = 1000.0, 2
    windows = [(0.0, 1.0), (10.0, 11.0)]
    names = {TRAINER: "trainer-0", WORKER: "worker-0"}

    def at(seconds: float, pid: int, function: str, times: int) -> list[Sample]:
        comm = "swapper" if pid == 0 else "rollout"
        return [Sample(comm, pid, seconds, function)] * times

    samples = [
        *at(0.5, TRAINER, "__memmove_avx_unaligned_erms", 300),
        *at(10.5, TRAINER, "_copy_from_iter", 100),
        *at(0.5, WORKER, "XXH3_hashLong_64b_internal", 200),
        *at(10.2, 999, "sshd_loop", 50),
        *at(0.7, 0, "default_idle", 700),
        # Between the syncs and after them: not counted.
        *at(5.0, TRAINER, "__memmove_avx_unaligned_erms", 5000),
        *at(12.0, WORKER, "_copy_to_iter", 5000),
    ]
    cpu = sync_cpu.attribute(samples, windows, names, rate, cores)
    assert cpu["syncs"] == 2
    # 650 busy samples at 1000 per second over two syncs.
    assert cpu["cpu_seconds_per_sync"] == pytest.approx(0.325)
    assert cpu["cpu_bound_seconds"] == pytest.approx(0.325 / cores)
    assert cpu["busy_cores"] == pytest.approx(0.325 / 1.0)
    assert cpu["idle_seconds_per_sync"] == pytest.approx(0.35)
    assert cpu["by_process"] == pytest.approx(
        {"trainer-0": 0.2, "worker-0": 0.1, sync_cpu.OTHER_PROCESSES: 0.025}
    )
    assert cpu["by_process_and_work"]["trainer-0"] == pytest.approx(
        {"memory copies in user space": 0.15, "kernel socket copies": 0.05}
    )
    assert cpu["by_work"]["XXH3 hashing"] == pytest.approx(0.1)
    assert cpu["top_functions"][0] == ["trainer-0", "__memmove_avx_unaligned_erms", pytest.approx(0.15)]


def test_no_sync_in_the_profile_gives_zeros_not_a_division_by_zero() -> None:
    cpu = sync_cpu.attribute([Sample("rollout", TRAINER, 1.0, "f")], [], {}, 1000.0, 2)
    assert cpu["syncs"] == 0
    assert cpu["cpu_seconds_per_sync"] == 0.0
    assert cpu["busy_cores"] == 0.0


def test_the_profiler_samples_every_cpu_on_the_traces_clock() -> None:
    command = sync_cpu.record_command(Path("/tmp/x.data"))
    assert command[:2] == ["perf", "record"]
    assert "-a" in command and command[command.index("-k") + 1] == "CLOCK_REALTIME"
    assert command[-1] == "--"
