"""End to end: `rollout report` draws two real runs into one self-contained HTML page, with
`--png` each chart as a PNG too, and a headless Chromium renders the page (skipped where
Chromium is not installed)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.harness import rollout, run, write_config

RUN_NAMES = ("baseline", "seed-11")
# The report's colours for the first and second run (Tableau 10 blue and orange).
RUN_COLOURS = ((0x4E, 0x79, 0xA7), (0xF2, 0x8E, 0x2B))
LINE_CHARTS = ("reward", "loss", "length", "samples_per_second", "tokens_per_second")
BACKGROUND = np.array((0xF5, 0xF6, 0xF8))
CHROMIUM_INSTALL = "apt-get install -y --no-install-recommends chromium"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, artifacts: Path) -> list[Path]:
    """Two 3-step GRPO runs of the tiny model, with different names and seeds."""
    dirs = []
    for name, seed in zip(RUN_NAMES, ("7", "11"), strict=True):
        directory = tmp_path_factory.mktemp(name)
        config = write_config(directory, artifacts, steps=3)
        run(config, "--set", f"run.name={name}", "--set", f"run.seed={seed}")
        dirs.append(directory / "out")
    return dirs


def report(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    return rollout("report", *args, check=check, timeout=60)


def svgs(html: str) -> dict[str, str]:
    """Each chart's `<svg>` element by its `data-chart`."""
    found = re.findall(r'(<svg[^>]*class="chart" data-chart="([^"]+)".*?</svg>)', html, re.S)
    charts = {chart: svg for svg, chart in found}
    assert len(charts) == len(found), "two charts share an id"
    return charts


def test_report_overlays_the_runs_in_a_self_contained_page(tmp_path: Path, runs: list[Path]) -> None:
    output = tmp_path / "R.html"
    result = report(*runs, "--output", output)
    assert str(output) in result.stdout
    html = output.read_text()
    # Self-contained: nothing is fetched, nothing runs.
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.I)
    assert not re.search(r"<script|<link|<img|<iframe|@import|url\(", html, re.I)
    charts = svgs(html)
    assert set(LINE_CHARTS) <= charts.keys()
    assert {"phases-1", "phases-2"} <= charts.keys()
    for chart in LINE_CHARTS:
        names = re.findall(r'class="series" data-run="([^"]+)"', charts[chart])
        assert names == list(RUN_NAMES), chart
        # Axes with ticks and labels, and a legend naming both runs.
        assert ">step</text>" in charts[chart]
        assert len(re.findall(r'text-anchor="end">[^<]+</text>', charts[chart])) >= 3, chart
        assert all(f">{name}</text>" in charts[chart] for name in RUN_NAMES), chart
    assert charts["reward"].count('class="band"') == 2, "reward_mean ± reward_std"
    for chart in ("phases-1", "phases-2"):
        phases = re.findall(r'class="area" data-phase="([^"]+)"', charts[chart])
        assert {"generate", "score", "train", "other"} <= set(phases), chart
    summary = re.search(r'<table class="summary">(.*?)</table>', html, re.S)
    assert summary and all(name in summary.group(1) for name in RUN_NAMES)
    assert "3 / 3" in summary.group(1), "steps logged / planned"


def svg_size(svg: str) -> tuple[int, int]:
    width, height = re.search(r'<svg[^>]* width="([\d.]+)" height="([\d.]+)"', svg).groups()
    return round(float(width)), round(float(height))


def test_png_charts_beside_the_page_and_in_a_directory(tmp_path: Path, runs: list[Path]) -> None:
    image_module = pytest.importorskip("PIL.Image")
    output = tmp_path / "R.html"
    result = report(*runs, "--output", output, "--png")
    charts = svgs(output.read_text())
    folder = tmp_path / "R_files"
    assert f"{len(charts)} PNG charts: {folder}" in result.stdout
    assert sorted(path.name for path in folder.iterdir()) == sorted(f"{chart}.png" for chart in charts)
    for chart, svg in charts.items():
        data = (folder / f"{chart}.png").read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n"), chart
        image = image_module.open(folder / f"{chart}.png")
        image.load()  # decodes every row: a truncated or corrupt file raises here
        width, height = svg_size(svg)
        assert image.size == (2 * width, 2 * height), chart
        pixels = np.asarray(image.convert("RGB")).astype(np.int16)
        colours = np.unique(pixels.reshape(-1, 3), axis=0)
        assert len(colours) > 50, f"{chart}: only {len(colours)} colours"
        white = (pixels.min(axis=2) > 250).mean()
        # Not blank, not painted over; a phase chart's stacked areas fill as much of its plot
        # as the run's phases do (one CI run measured 48.6% white).
        least_white = 0.2 if chart.startswith("phases") else 0.5
        assert least_white < white < 0.99, f"{chart}: {white:.1%} white"
        if chart in LINE_CHARTS:
            for colour in RUN_COLOURS:
                near = (np.abs(pixels - np.array(colour)).max(axis=2) < 8).sum()
                assert near > 500, f"{chart}: the run colour {colour} covers only {near} pixels"
    elsewhere = tmp_path / "pngs"
    report(runs[0], "--output", tmp_path / "one.html", "--png-dir", elsewhere)
    assert (elsewhere / "reward.png").is_file()
    assert not (tmp_path / "one_files").exists()


def test_default_output_smoothing_and_a_partial_line(tmp_path: Path, runs: list[Path]) -> None:
    copy = tmp_path / "live"
    shutil.copytree(runs[0], copy, ignore=shutil.ignore_patterns("checkpoints", "summary.json"))
    with (copy / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"step": 4, "reward_mean": 0.')  # a run still writing its line
    result = report(copy, "--smooth", "0.6")
    html = (copy / "report.html").read_text()
    assert str(copy / "report.html") in result.stdout
    assert "incomplete" in html
    charts = svgs(html)
    assert charts["reward"].count('class="raw"') == 1
    assert "running or stopped" in html, "no summary.json yet"
    assert "baseline" in html, "named from config.toml without a summary"


def test_a_directory_without_metrics_is_a_clear_error(tmp_path: Path) -> None:
    result = report(tmp_path, check=False)
    assert result.returncode == 1
    assert str(tmp_path / "metrics.jsonl") in result.stderr
    assert "output directory" in result.stderr
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\nnot json\n{"step": 3}\n')
    result = report(tmp_path, check=False)
    assert result.returncode == 1
    assert f"{tmp_path / 'metrics.jsonl'}:2:" in result.stderr


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


@pytest.mark.skipif(chromium() is None, reason=f"Chromium is not installed ({CHROMIUM_INSTALL})")
def test_chromium_renders_the_charts(tmp_path: Path, runs: list[Path]) -> None:
    image_module = pytest.importorskip("PIL.Image")
    page = tmp_path / "R.html"
    report(*runs, "--output", page)
    screenshot = tmp_path / "screenshot.png"
    result = subprocess.run(
        [
            str(chromium()),
            "--headless",
            "--no-sandbox",  # as root (CI containers) Chromium refuses its sandbox
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1280,2600",
            f"--screenshot={screenshot}",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert screenshot.exists(), f"no screenshot (exit {result.returncode})\n{result.stderr[-3000:]}"
    image = np.asarray(image_module.open(screenshot).convert("RGB")).astype(np.int16)
    assert image.shape == (2600, 1280, 3)
    colours = np.unique(image.reshape(-1, 3), axis=0)
    assert len(colours) > 200, f"only {len(colours)} colours: the page looks blank"
    background = (np.abs(image - BACKGROUND).max(axis=2) < 3) | (image.min(axis=2) > 250)
    assert background.mean() < 0.97, "almost nothing but background"
    for colour in RUN_COLOURS:
        # Each run's lines, markers and legend entries, in its colour, spread down the page
        # (every chart), not in one spot. How many rows a line covers depends on the run's
        # data (a run whose reward stays 0 draws flat lines), so the spread is counted in
        # bands of 100 rows: the runs table, the legend of each row of charts, the phase
        # table and the phase charts' legends are in at least six of them whatever the data.
        near = np.abs(image - np.array(colour)).max(axis=2) < 24
        bands = {int(row) // 100 for row in np.nonzero(near.any(axis=1))[0]}
        assert near.sum() > 1500, f"the run colour {colour} covers only {near.sum()} pixels"
        assert len(bands) >= 6, f"the run colour {colour} is in only the row bands {sorted(bands)}"
    print(f"screenshot: {screenshot}, {len(colours)} colours, {1 - background.mean():.1%} not background")
