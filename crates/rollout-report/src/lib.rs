//! `rollout report RUN_DIR...`: one self-contained HTML page (inline CSS and SVG, no scripts)
//! with the curves of one or more runs' `metrics.jsonl` (reward, loss, KL, completion
//! length, throughput) and where their time went; several runs are overlaid, one colour each.
//! With `--png` each chart is also written as a PNG file (png.rs). See docs/integrations.md.

mod agents;
mod charts;
mod error;
mod html;
mod line;
mod load;
mod phases;
pub mod png;
#[cfg(test)]
mod png_tests;
mod scale;
mod summary;
mod svg;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

pub use error::ReportError;
pub use load::{Metrics, Run, Summary, load_run, load_runs, parse_metrics};
pub use summary::RunFigures;
pub use svg::escape;

/// What `rollout report` was asked for.
#[derive(Debug, Clone, Default)]
pub struct Options {
    pub run_dirs: Vec<PathBuf>,
    /// The page; default `report.html` in the first run directory.
    pub output: Option<PathBuf>,
    /// Weight of the exponential moving average drawn over each line, in `[0, 1)`; 0: none.
    pub smoothing: f64,
}

/// Whether, and where, `write_with_png` writes each chart as `<id>.png`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum PngOutput {
    /// The page only.
    #[default]
    Off,
    /// Beside the page: `R.html` → `R_files/` ([`png::default_dir`]).
    NextToPage,
    /// In this directory.
    Dir(PathBuf),
}

/// What `write` wrote.
#[derive(Debug, Clone)]
pub struct Written {
    pub html: PathBuf,
    pub runs: usize,
    /// The ids of the charts, in the page's order.
    pub charts: Vec<String>,
    /// The charts' PNG files, in the same order (empty without PNG output).
    pub pngs: Vec<PathBuf>,
    /// Font faces the PNGs' labels could use (0: drawn without text); 0 without PNGs.
    pub png_font_faces: usize,
}

/// A rendered report: the page, and each chart on its own (`(id, <svg>)`).
#[derive(Debug, Clone)]
pub struct Report {
    pub html: String,
    pub charts: Vec<(String, String)>,
}

/// Reads the runs, renders the page and writes it (atomically: a reader never sees half).
pub fn write(options: &Options) -> Result<Written, ReportError> {
    write_with_png(options, &PngOutput::Off)
}

/// [`write`], and each chart as a PNG where `png` says.
pub fn write_with_png(options: &Options, png: &PngOutput) -> Result<Written, ReportError> {
    if !(0.0..1.0).contains(&options.smoothing) {
        return Err(ReportError::Smoothing(options.smoothing));
    }
    let first = options.run_dirs.first().ok_or(ReportError::NoRuns)?;
    let runs = load_runs(&options.run_dirs)?;
    if runs.iter().all(|run| run.steps.is_empty()) {
        return Err(ReportError::NoSteps {
            paths: runs.iter().map(|r| r.dir.display().to_string()).collect(),
        });
    }
    let report = render(&runs, options.smoothing);
    let path = options
        .output
        .clone()
        .unwrap_or_else(|| first.join("report.html"));
    write_atomically(&path, report.html.as_bytes())?;
    let png_dir = match png {
        PngOutput::Off => None,
        PngOutput::NextToPage => Some(png::default_dir(&path)),
        PngOutput::Dir(dir) => Some(dir.clone()),
    };
    let (pngs, png_font_faces) = match png_dir {
        Some(dir) => write_pngs(&report.charts, &dir)?,
        None => (Vec::new(), 0),
    };
    Ok(Written {
        html: path,
        runs: runs.len(),
        charts: report.charts.into_iter().map(|(id, _)| id).collect(),
        pngs,
        png_font_faces,
    })
}

/// Each chart as `dir/<id>.png`; the files, and the font faces their labels could use.
fn write_pngs(
    charts: &[(String, String)],
    dir: &Path,
) -> Result<(Vec<PathBuf>, usize), ReportError> {
    let rasterizer = png::Rasterizer::with_system_fonts();
    let faces = rasterizer.font_faces();
    if faces == 0 {
        tracing::warn!("no fonts found: the PNG charts are drawn without their labels");
    }
    let mut written = Vec::with_capacity(charts.len());
    for (id, svg) in charts {
        let bytes = rasterizer.png(svg).map_err(|source| ReportError::Png {
            chart: id.clone(),
            source,
        })?;
        let path = dir.join(format!("{id}.png"));
        write_atomically(&path, &bytes)?;
        written.push(path);
    }
    Ok((written, faces))
}

/// The page for `runs`, with lines smoothed by `smoothing` (0: none).
pub fn render(runs: &[Run], smoothing: f64) -> Report {
    let mut charts: Vec<(String, String)> = charts::line_charts(runs, smoothing)
        .into_iter()
        .chain(agents::agent_charts(runs, smoothing))
        .map(|chart| (chart.id.clone(), chart.render()))
        .collect();
    let line_count = charts.len();
    for (index, run) in runs.iter().enumerate() {
        let id = format!("phases-{}", index + 1);
        let title = if runs.len() == 1 {
            "Step time by phase".to_owned()
        } else {
            format!("Step time by phase: {}", run.name)
        };
        if let Some(svg) = phases::stacked_chart(run, &id, &title) {
            charts.push((id, svg));
        }
    }
    let svgs: Vec<String> = charts.iter().map(|(_, svg)| svg.clone()).collect();
    let (lines, phase_charts) = svgs.split_at(line_count);
    let html = html::Page {
        runs,
        charts: lines,
        phase_charts,
    }
    .render();
    Report { html, charts }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ReportError> {
    let error = |source| ReportError::Write {
        path: path.to_path_buf(),
        source,
    };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(error)?;
    }
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".tmp");
    let temporary = PathBuf::from(temporary);
    std::fs::write(&temporary, bytes).map_err(error)?;
    std::fs::rename(&temporary, path).map_err(error)
}
