//! Line charts: one metric over the steps, one line per run, with an optional band.

use std::fmt::Write;

use super::svg::escape;
use super::svg::{Frame, Plot};

/// Series with at most this many points get a marker on each.
const MARKER_LIMIT: usize = 40;

/// One run's line in a chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub label: String,
    pub color: String,
    /// `(step, value)`, by step: the line (smoothed, when smoothing is on).
    pub points: Vec<(f64, f64)>,
    /// The unsmoothed values, drawn faintly under a smoothed line.
    pub raw: Option<Vec<(f64, f64)>>,
    /// `(step, low, high)`: a shaded band around the line.
    pub band: Vec<(f64, f64, f64)>,
}

/// A chart of one metric.
#[derive(Debug, Clone)]
pub struct LineChart {
    pub id: String,
    pub title: String,
    pub subtitle: Option<String>,
    pub y_label: String,
    pub y_from_zero: bool,
    pub series: Vec<Series>,
}

impl LineChart {
    /// The chart as an `<svg>` element; each run's line is a `<path class="series">`.
    pub fn render(&self) -> String {
        let frame = Frame {
            id: self.id.clone(),
            title: self.title.clone(),
            subtitle: self.subtitle.clone(),
            x_label: "step".into(),
            y_label: self.y_label.clone(),
            legend: self
                .series
                .iter()
                .map(|s| (s.label.clone(), s.color.clone()))
                .collect(),
            x: extent(
                self.series
                    .iter()
                    .flat_map(|s| s.points.iter().map(|p| p.0)),
            ),
            y: extent(self.series.iter().flat_map(series_values)),
            y_from_zero: self.y_from_zero,
        };
        frame.render(|plot| {
            let mut svg = String::new();
            for series in &self.series {
                svg.push_str(&series_svg(series, plot));
            }
            svg
        })
    }
}

/// Every value a series draws: its line, band and raw values.
fn series_values(series: &Series) -> impl Iterator<Item = f64> + '_ {
    let line = series.points.iter().map(|p| p.1);
    let band = series.band.iter().flat_map(|b| [b.1, b.2]);
    let raw = series.raw.iter().flatten().map(|p| p.1);
    line.chain(band).chain(raw)
}

/// `(min, max)` of the finite values; `(NaN, NaN)` when there are none.
pub fn extent(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values
        .filter(|v| v.is_finite())
        .fold((f64::NAN, f64::NAN), |(low, high), v| {
            (low.min(v), high.max(v))
        })
}

fn series_svg(series: &Series, plot: &Plot) -> String {
    let colour = escape(&series.color);
    let label = escape(&series.label);
    let mut svg = String::new();
    if !series.band.is_empty() {
        let _ = write!(
            svg,
            r#"<path class="band" d="{}" fill="{colour}" fill-opacity="0.15" stroke="none"/>"#,
            band_path(&series.band, plot)
        );
    }
    if let Some(raw) = &series.raw {
        let _ = write!(
            svg,
            r#"<path class="raw" d="{}" fill="none" stroke="{colour}" stroke-opacity="0.3" stroke-width="1"/>"#,
            line_path(raw, plot)
        );
    }
    let _ = write!(
        svg,
        r#"<path class="series" data-run="{label}" d="{}" fill="none" stroke="{colour}" stroke-width="2" stroke-linejoin="round" stroke-linecap="round"><title>{label}</title></path>"#,
        line_path(&series.points, plot)
    );
    if series.points.len() <= MARKER_LIMIT {
        for &(x, y) in &series.points {
            let _ = write!(
                svg,
                r#"<circle class="marker" cx="{:.1}" cy="{:.1}" r="2.5" fill="{colour}"/>"#,
                plot.x.map(x),
                plot.y.map(y)
            );
        }
    }
    svg
}

/// SVG path data through `points`: `M x,y L x,y ...`.
pub fn line_path(points: &[(f64, f64)], plot: &Plot) -> String {
    let mut data = String::new();
    for (index, &(x, y)) in points.iter().enumerate() {
        let command = if index == 0 { 'M' } else { 'L' };
        let _ = write!(data, "{command}{:.1},{:.1}", plot.x.map(x), plot.y.map(y));
    }
    data
}

/// A closed path along the band's tops, then back along its bottoms.
pub fn band_path(band: &[(f64, f64, f64)], plot: &Plot) -> String {
    let upper: Vec<(f64, f64)> = band.iter().map(|b| (b.0, b.2)).collect();
    let lower: Vec<(f64, f64)> = band.iter().rev().map(|b| (b.0, b.1)).collect();
    let mut data = line_path(&upper, plot);
    for &(x, y) in &lower {
        let _ = write!(data, "L{:.1},{:.1}", plot.x.map(x), plot.y.map(y));
    }
    data.push('Z');
    data
}

/// Exponential moving average with `weight` on the past (TensorBoard's smoothing), with its
/// start-up bias corrected so that the first points are not pulled towards zero.
pub fn smooth(points: &[(f64, f64)], weight: f64) -> Vec<(f64, f64)> {
    if weight <= 0.0 {
        return points.to_vec();
    }
    let weight = weight.min(0.999);
    let mut average = 0.0;
    let mut debias = 1.0;
    points
        .iter()
        .map(|&(x, y)| {
            average = average * weight + (1.0 - weight) * y;
            debias *= weight;
            (x, average / (1.0 - debias))
        })
        .collect()
}
