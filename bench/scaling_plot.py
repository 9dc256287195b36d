"""``bench/scaling``'s plot: step time and peak memory against each axis, log-log, with the fits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.scaling_runs import AXES

TITLES = {
    "model": "parameters",
    "length": "completion tokens",
    "group": "group size",
    "workers": "workers",
}
# One row of panels each: (point key, fit key, scale, y label).
ROWS = (
    ("step_seconds", "step_seconds", 1.0, "step seconds"),
    ("peak_rss_bytes", "peak_rss", 2**-20, "peak RSS (MiB)"),
)


def plot(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (bench/requirements-trl.txt): no plot", flush=True)
        return False
    matplotlib.use("Agg")
    from matplotlib import pyplot

    axes_done = [a for a in AXES if a in results["axes"]]
    figure, grid = pyplot.subplots(2, len(axes_done), figsize=(3.6 * len(axes_done), 6.2), squeeze=False)
    for column, axis in enumerate(axes_done):
        for row in range(len(ROWS)):
            draw_panel(grid[row][column], axis, results["axes"][axis], row)
    labels: dict[str, Any] = {}
    for panel in grid.flat:
        for handle, label in zip(*panel.get_legend_handles_labels(), strict=True):
            labels.setdefault(label, handle)
    figure.legend(labels.values(), labels.keys(), loc="lower center", ncol=len(labels), fontsize=8)
    quick = " (quick smoke run)" if results.get("quick") else ""
    figure.suptitle(f"RL step time and peak memory against work, log-log{quick}", fontsize=11)
    figure.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return True


def draw_panel(panel: Any, axis: str, data: dict[str, Any], row: int) -> None:
    """One axis's step seconds (row 0, with the generate and train phases) or peak RSS (row 1)."""
    key, fit_key, scale, unit = ROWS[row]
    points = [p for p in data["points"] if p.get(key)]
    if row == 0:
        draw_phases(panel, points)
    for kind, marker in (("measured", "o"), ("modelled", "s")):
        chosen = [p for p in points if p["kind"] == kind]
        if chosen:
            panel.plot(
                [p["x"] for p in chosen],
                [p[key] * scale for p in chosen],
                marker,
                color="tab:blue" if row == 0 else "tab:orange",
                fillstyle="full" if kind == "measured" else "none",
                markersize=7,
                label=kind,
            )
    fit = data["fit"].get(fit_key)
    if fit and points:
        draw_fit(panel, fit, points, scale)
    format_panel(panel, axis, data, unit)
    if row == 0:
        base = data["base"]
        panel.set_title(
            f"{axis} axis\nbase: {base['model']} model, {base['prompts']} prompts x "
            f"{base['group']}, {base['length']} tokens",
            fontsize=9,
        )
    panel.grid(alpha=0.3, which="both")


def draw_phases(panel: Any, points: list[dict[str, Any]]) -> None:
    for phase, style in (("generate", ":"), ("train", "-.")):
        with_phase = [p for p in points if p.get("phase_seconds")]
        panel.plot(
            [p["x"] for p in with_phase],
            [max(p["phase_seconds"][phase], 1e-3) for p in with_phase],
            style,
            color="tab:green" if phase == "generate" else "tab:purple",
            linewidth=1,
            label=f"{phase} phase",
        )


def draw_fit(panel: Any, fit: dict[str, Any], points: list[dict[str, Any]], scale: float) -> None:
    lo, hi = points[0]["x"], points[-1]["x"]
    xs = [lo * (hi / lo) ** (i / 40) for i in range(41)]
    panel.plot(
        xs,
        [fit["coefficient"] * x ** fit["exponent"] * scale for x in xs],
        "--",
        color="grey",
        label="power-law fit",
    )
    panel.text(
        0.04,
        0.95,
        f"exponent {fit['exponent']:.2f}",
        transform=panel.transAxes,
        fontsize=8,
        verticalalignment="top",
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8},
    )


def format_panel(panel: Any, axis: str, data: dict[str, Any], unit: str) -> None:
    """Log-log scales, a tick at every point, and the axis labels."""
    from matplotlib import ticker

    panel.set_xscale("log")
    panel.set_yscale("log")
    panel.set_xticks(
        [p["x"] for p in data["points"]],
        [f"{p['x'] / 1e6:.3g}M" if axis == "model" else p["label"] for p in data["points"]],
    )
    panel.xaxis.set_minor_formatter(ticker.NullFormatter())
    panel.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    panel.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    panel.yaxis.set_minor_formatter(ticker.NullFormatter())
    panel.set_xlabel(TITLES[axis])
    panel.set_ylabel(unit)
