"""Ratios, the markdown tables in ``docs/benchmarks.md`` and the learning-curve plot."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from bench.e2e import REPO
from bench.e2e.runs import PHASES, SIZES
from bench.hosts import carry_other_hosts

DOCS = REPO / "docs" / "benchmarks.md"
PLOT = REPO / "docs" / "e2e_vs_trl_learning.png"
BEGIN, END = "<!-- e2e:begin -->", "<!-- e2e:end -->"


def learning_verdict(rollout: Sequence[float], trl: Sequence[float]) -> dict[str, Any]:
    """Mean step reward over the second half of each run; Rollout is "not worse" unless it
    trails TRL by more than two standard errors of the difference (step rewards are noisy:
    each step sees different prompts)."""

    def half(values: Sequence[float]) -> list[float]:
        return list(values[len(values) // 2 :])

    late_rollout, late_trl = half(rollout), half(trl)
    standard_error = (
        statistics.variance(late_rollout) / len(late_rollout) + statistics.variance(late_trl) / len(late_trl)
    ) ** 0.5
    difference = statistics.fmean(late_rollout) - statistics.fmean(late_trl)
    return {
        "second_half_reward": {"rollout": statistics.fmean(late_rollout), "trl": statistics.fmean(late_trl)},
        "difference": difference,
        "standard_error": standard_error,
        "not_worse": difference >= -2 * standard_error,
    }


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def pair_ratios(rollout: Mapping[str, Any], trl: Mapping[str, Any]) -> dict[str, float]:
    ratios = {
        "throughput_ratio": ratio(rollout["completions_per_second"], trl["completions_per_second"]),
        "generated_tokens_ratio": ratio(
            rollout["generated_tokens_per_second"], trl["generated_tokens_per_second"]
        ),
        "memory_ratio": ratio(rollout["peak_rss_bytes"], trl["peak_rss_bytes"]),
        "step_seconds_ratio": ratio(rollout["step_seconds"], trl["step_seconds"]),
    }
    for name in PHASES:
        ratios[f"{name}_seconds_ratio"] = ratio(rollout["phase_seconds"][name], trl["phase_seconds"][name])
    return ratios


def headline(pairs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per framework the median over repeats, and the median of the per-repeat ratios."""
    result: dict[str, Any] = {}
    for key in (
        "completions_per_second",
        "generated_tokens_per_second",
        "peak_rss_bytes",
        "compute_bound_fraction",
        "train_compute_bound_fraction",
    ):
        result[key] = {fw: statistics.median(p[fw][key] for p in pairs) for fw in ("rollout", "trl")}
    for key in ("throughput_ratio", "memory_ratio", "generated_tokens_ratio"):
        result[key] = statistics.median(p["ratios"][key] for p in pairs)
        result[f"{key}_per_repeat"] = [p["ratios"][key] for p in pairs]
    return result


# A host's figures kept beside the latest run on another host, per model size.
HOST_FIGURES = ("throughput_ratio", "memory_ratio", "compute_bound_fraction", "train_compute_bound_fraction")


def host_summary(results: Mapping[str, Any]) -> dict[str, Any]:
    """A run's headline figures per model size (fp32, no KL term), with its date, command and
    learning verdicts."""
    learning = results.get("learning") or {}
    return {
        "date": results["date"],
        "command": results["command"],
        "cores": results["machine"]["cores"],
        **{size: {key: results[size][key] for key in HOST_FIGURES} for size in SIZES if size in results},
        "learning_not_worse": {size: v["not_worse"] for size, v in learning.get("verdicts", {}).items()},
    }


def other_hosts(previous: Mapping[str, Any] | None, cpu: str) -> dict[str, Any]:
    """The latest figures of every host but `cpu`, carried over from the `previous` results
    file (written on whichever host ran before)."""
    return carry_other_hosts(previous, cpu, lambda results: results["machine"]["cpu"], host_summary)


def markdown(results: Mapping[str, Any]) -> str:
    lines = _machine_lines(results)
    for precision, table in results["tables"].items():
        lines += _precision_lines(results, precision, table)
    learning = results.get("learning")
    if learning:
        lines += _learning_lines(results, learning)
    return "\n".join(lines)


def _machine_lines(results: Mapping[str, Any]) -> list[str]:
    all_limits = results["machine"]["limits"]
    any_limits = next(iter(all_limits.values()))
    return [
        f"Measured {results['date']} on {results['machine']['cpu']} ({results['machine']['cores']} cores), "
        f"torch {results['versions']['torch']}, transformers {results['versions']['transformers']}, "
        f"TRL {results['versions']['trl']}, {results['workload']['threads']} torch threads in both. "
        f"Command: `{results['command']}`.",
        "",
        *_overlap_lines(results),
        "Machine limits: fp32 matrix multiply "
        + ", ".join(f"{size} {limits['gemm_gflops']:.0f} GFLOP/s" for size, limits in all_limits.items())
        + f" (at the model's shapes, {any_limits['gemm_rows']} rows); "
        f"memory copy {any_limits['copy_gbytes_per_second']:.1f} GB/s; a Python process that has "
        f"only imported torch: {_mib(results['machine']['import_torch_rss_bytes'])}.",
        "",
        *_other_host_lines(results),
    ]


def _other_host_lines(results: Mapping[str, Any]) -> list[str]:
    """The latest headline figures measured on each other host, from `other_hosts`."""
    lines = []
    for cpu, host in results.get("other_hosts", {}).items():
        sizes = [
            f"{size} {host[size]['throughput_ratio']:.2f}x TRL's completions/s at "
            f"{host[size]['memory_ratio']:.2f}x its peak memory"
            for size in SIZES
            if size in host
        ]
        lines.append(
            f"The latest run on {cpu} ({host['cores']} cores, {host['date']}, `{host['command']}`; "
            f"fp32, no KL): {'; '.join(sizes)}."
        )
    return [*lines, ""] if lines else []


def _overlap_lines(results: Mapping[str, Any]) -> list[str]:
    """Which sizes' Rollout runs overlapped generation with training, if any."""
    sizes = sorted(
        {
            row["size"]
            for table in results["tables"].values()
            for row in table
            if any(pair["rollout"].get("overlapped") for pair in row["pairs"])
        }
    )
    if not sizes:
        return []
    return [
        f"Rollout's {', '.join(sizes)} runs overlap generation with training (`cluster.max_staleness = 1`: "
        "a generation copy of the policy samples step k + 1 on its own interpreter thread while step k "
        f"trains, {max(1, results['workload']['threads'] // 2)} torch thread per copy), so each trained "
        "sample is at most one update old, corrected by the clipped importance ratio; TRL's runs are "
        "synchronous. The phases of an overlapped run add up to more than its step.",
        "",
    ]


def _precision_lines(results: Mapping[str, Any], precision: str, table: list[dict[str, Any]]) -> list[str]:
    """A precision's headline table (one row per model and KL value) and its phase table."""
    lines = [
        f"**{precision}** (medians over {results['measured_steps']} steps after "
        f"{results['warmup_steps']} warm-up steps; ratio = Rollout / TRL, one per repeat)",
        "",
        "| model | KL | completions/s Rollout | TRL | ratio | tokens/s ratio "
        "| peak RSS Rollout | TRL | ratio | ratio above torch "
        "| compute-bound fraction Rollout | TRL | training phase Rollout | TRL |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    floor = results["machine"]["import_torch_rss_bytes"]
    for row in table:
        h = row["headline"]
        rss = h["peak_rss_bytes"]
        lines.append(
            f"| {row['size']} | {row['kl_coef']:g} "
            f"| {h['completions_per_second']['rollout']:.0f} | {h['completions_per_second']['trl']:.0f} "
            f"| **{h['throughput_ratio']:.2f}x** ({_list(h['throughput_ratio_per_repeat'])}) "
            f"| {h['generated_tokens_ratio']:.2f}x "
            f"| {_mib(rss['rollout'])} | {_mib(rss['trl'])} "
            f"| **{h['memory_ratio']:.2f}x** ({_list(h['memory_ratio_per_repeat'])}) "
            f"| {ratio(rss['rollout'] - floor, rss['trl'] - floor):.2f}x "
            f"| {h['compute_bound_fraction']['rollout']:.2f} | {h['compute_bound_fraction']['trl']:.2f} "
            f"| {h['train_compute_bound_fraction']['rollout']:.2f} "
            f"| {h['train_compute_bound_fraction']['trl']:.2f} |"
        )
    lines += ["", "Seconds per step by phase, median (first repeat):", ""]
    lines += [
        "| model | KL | framework | " + " | ".join(PHASES) + " | step |",
        "|---|---|---|" + "---|" * 7,
    ]
    for row in table:
        for fw in ("rollout", "trl"):
            run = row["pairs"][0][fw]
            phases = " | ".join(f"{run['phase_seconds'][name]:.3f}" for name in PHASES)
            lines.append(
                f"| {row['size']} | {row['kl_coef']:g} | {fw} | {phases} | {run['step_seconds']:.3f} |"
            )
    lines.append("")
    return lines


def _learning_lines(results: Mapping[str, Any], learning: Mapping[str, Any]) -> list[str]:
    lines = [
        "Learning check: both from the same warm-started checkpoint, KL 0, fp32, "
        + ", ".join(f"{size} {steps} steps" for size, steps in learning["steps"].items())
        + f" of {results['workload']['completions_per_step']} completions. Mean exact-match reward:",
        "",
        "| model | framework | first 10 steps | last 10 steps | second half | whole run |",
        "|---|---|---|---|---|---|",
    ]
    for size, curves in learning["curves"].items():
        for fw in ("rollout", "trl"):
            c = curves[fw]
            lines.append(
                f"| {size} | {fw} | {statistics.fmean(c[:10]):.3f} | {statistics.fmean(c[-10:]):.3f} "
                f"| {statistics.fmean(c[len(c) // 2 :]):.3f} | {statistics.fmean(c):.3f} |"
            )
    lines.append("")
    for size, verdict in learning["verdicts"].items():
        lines.append(
            f"- {size}: Rollout - TRL over the second half {verdict['difference']:+.3f} "
            f"(standard error {verdict['standard_error']:.3f}): "
            + ("not worse." if verdict["not_worse"] else "**worse** (by more than two standard errors).")
        )
    return [*lines, "", f"![reward curves](./{PLOT.name})", ""]


def _mib(value: float) -> str:
    return f"{value / 2**20:.0f} MiB"


def _list(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def write_docs(text: str) -> None:
    doc = DOCS.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{DOCS} lacks the {BEGIN} ... {END} markers")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOCS.write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def plot_learning(curves: Mapping[str, Mapping[str, Sequence[float]]], per_step: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(1, len(curves), figsize=(5.5 * len(curves), 3.8), squeeze=False)
    for axis, (size, by_framework) in zip(axes[0], curves.items(), strict=True):
        for (framework, rewards), colour in zip(
            by_framework.items(), ("tab:blue", "tab:orange"), strict=False
        ):
            completions = [per_step * (i + 1) for i in range(len(rewards))]
            axis.plot(completions, rewards, color=colour, alpha=0.25, linewidth=1)
            axis.plot(completions, moving_average(rewards, 10), color=colour, label=framework, linewidth=2)
        axis.set_title(f"{size} model, KL 0, fp32 (thin: per step, thick: 10-step mean)", fontsize=9)
        axis.set_xlabel("completions")
        axis.set_ylabel("exact-match reward")
        axis.legend()
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(PLOT, dpi=110)


def moving_average(values: Sequence[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def report(results: Mapping[str, Any]) -> None:
    """The plot and the tables in the docs, from ``results``."""
    learning = results.get("learning")
    if learning and learning["curves"]:
        plot_learning(learning["curves"], results["workload"]["completions_per_step"])
    write_docs(markdown(results))
    print(f"updated {DOCS.relative_to(REPO)} and {PLOT.relative_to(REPO)}")
