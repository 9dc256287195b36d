//! The frame every chart shares: title, legend, axes with ticks, grid and labels.

use std::fmt::Write;

use super::scale::{Scale, format_number, nice_domain, nice_step};

pub const WIDTH: f64 = 640.0;
const PLOT_HEIGHT: f64 = 240.0;
const LEFT: f64 = 68.0;
const RIGHT: f64 = 20.0;
const TITLE_HEIGHT: f64 = 34.0;
const SUBTITLE_HEIGHT: f64 = 16.0;
const LEGEND_ROW: f64 = 18.0;
const BOTTOM: f64 = 46.0;
/// About this many pixels per character of the 12px legend font.
const CHAR_WIDTH: f64 = 6.6;

/// Distinct colours for runs (Tableau 10).
pub const PALETTE: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac",
];

/// The colour of the run at `index`.
pub fn color(index: usize) -> &'static str {
    PALETTE[index % PALETTE.len()]
}

/// What a chart shows around its data.
#[derive(Debug, Clone)]
pub struct Frame {
    /// `data-chart` of the `<svg>`: which chart it is.
    pub id: String,
    pub title: String,
    pub subtitle: Option<String>,
    pub x_label: String,
    pub y_label: String,
    /// `(label, colour)`; none is drawn for fewer than two entries.
    pub legend: Vec<(String, String)>,
    /// The data's extent, `(min, max)` on each axis.
    pub x: (f64, f64),
    pub y: (f64, f64),
    /// Whether the y axis starts at zero (amounts, as opposed to e.g. a loss).
    pub y_from_zero: bool,
}

/// Where the data goes, once the frame is laid out.
pub struct Plot {
    pub x: Scale,
    pub y: Scale,
}

impl Frame {
    /// The whole `<svg>`: the frame, and the data drawn by `body` on its scales.
    pub fn render(&self, body: impl FnOnce(&Plot) -> String) -> String {
        let legend_rows = legend_layout(&self.legend);
        let legend_height = legend_rows.len() as f64 * LEGEND_ROW;
        let subtitle_height = if self.subtitle.is_some() {
            SUBTITLE_HEIGHT
        } else {
            0.0
        };
        let top = TITLE_HEIGHT + subtitle_height + legend_height + 8.0;
        let height = top + PLOT_HEIGHT + BOTTOM;
        let (y_min, y_max) = if self.y_from_zero {
            (self.y.0.min(0.0), self.y.1.max(0.0))
        } else {
            self.y
        };
        let (y_low, y_high, y_ticks) = nice_domain(y_min, y_max, 5);
        let (x_low, x_high, x_ticks) = x_domain(self.x);
        let plot = Plot {
            x: Scale::new(x_low, x_high, LEFT, WIDTH - RIGHT),
            y: Scale::new(y_low, y_high, top + PLOT_HEIGHT, top),
        };
        let mut svg = format!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-chart="{}" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" role="img" aria-label="{}">"#,
            escape(&self.id),
            escape(&self.title)
        );
        svg.push_str(r##"<rect width="100%" height="100%" fill="#ffffff"/>"##);
        let _ = write!(
            svg,
            r##"<text x="{LEFT}" y="22" font-size="15" font-weight="600" fill="#222">{}</text>"##,
            escape(&self.title)
        );
        if let Some(subtitle) = &self.subtitle {
            let _ = write!(
                svg,
                r##"<text x="{LEFT}" y="{}" font-size="11" fill="#666">{}</text>"##,
                TITLE_HEIGHT + 4.0,
                escape(subtitle)
            );
        }
        svg.push_str(&legend_svg(
            &legend_rows,
            TITLE_HEIGHT + subtitle_height + 6.0,
        ));
        svg.push_str(&self.axes(&plot, &x_ticks, &y_ticks));
        let _ = write!(svg, r#"<g class="data">{}</g>"#, body(&plot));
        svg.push_str("</svg>");
        svg
    }

    /// Grid lines, ticks, tick labels and axis labels.
    fn axes(&self, plot: &Plot, x_ticks: &[f64], y_ticks: &[f64]) -> String {
        let (left, right) = (plot.x.from, plot.x.to);
        let (bottom, top) = (plot.y.from, plot.y.to);
        let mut svg = String::from(r##"<g class="axes" font-size="11" fill="#555">"##);
        for &tick in y_ticks {
            let y = plot.y.map(tick);
            let _ = write!(
                svg,
                r##"<line x1="{left:.1}" x2="{right:.1}" y1="{y:.1}" y2="{y:.1}" stroke="#e6e6e6"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                left - 6.0,
                y + 4.0,
                escape(&format_number(tick))
            );
        }
        for &tick in x_ticks {
            let x = plot.x.map(tick);
            let _ = write!(
                svg,
                r##"<line x1="{x:.1}" x2="{x:.1}" y1="{bottom:.1}" y2="{:.1}" stroke="#888"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                bottom + 5.0,
                bottom + 18.0,
                escape(&format_number(tick))
            );
        }
        let _ = write!(
            svg,
            r##"<path d="M{left:.1},{top:.1}V{bottom:.1}H{right:.1}" fill="none" stroke="#888"/>"##
        );
        let _ = write!(
            svg,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="12" fill="#333">{}</text>"##,
            (left + right) / 2.0,
            bottom + 38.0,
            escape(&self.x_label)
        );
        let middle = (top + bottom) / 2.0;
        let _ = write!(
            svg,
            r##"<text transform="translate(16,{middle:.1}) rotate(-90)" text-anchor="middle" font-size="12" fill="#333">{}</text>"##,
            escape(&self.y_label)
        );
        svg.push_str("</g>");
        svg
    }
}

/// The x axis (steps): whole-number ticks, the domain exactly the data's.
fn x_domain((min, max): (f64, f64)) -> (f64, f64, Vec<f64>) {
    let (min, max) = if min.is_finite() && max.is_finite() && min <= max {
        (min, max)
    } else {
        (0.0, 1.0)
    };
    let (min, max) = if min == max {
        (min - 1.0, max + 1.0)
    } else {
        (min, max)
    };
    let step = nice_step((max - min) / 6.0).max(1.0);
    let first = (min / step).ceil() * step;
    let count = ((max - first) / step).floor().max(0.0) as usize;
    let ticks = (0..=count).map(|i| first + i as f64 * step).collect();
    (min, max, ticks)
}

/// The legend's entries, row by row, each with its x offset; empty for fewer than two.
fn legend_layout(entries: &[(String, String)]) -> Vec<Vec<(f64, &str, &str)>> {
    if entries.len() < 2 {
        return Vec::new();
    }
    let available = WIDTH - LEFT - RIGHT;
    let mut rows: Vec<Vec<(f64, &str, &str)>> = vec![Vec::new()];
    let mut x = 0.0;
    for (label, colour) in entries {
        let width = 22.0 + label.chars().count() as f64 * CHAR_WIDTH + 14.0;
        if x > 0.0 && x + width > available {
            rows.push(Vec::new());
            x = 0.0;
        }
        if let Some(row) = rows.last_mut() {
            row.push((x, label.as_str(), colour.as_str()));
        }
        x += width;
    }
    rows
}

fn legend_svg(rows: &[Vec<(f64, &str, &str)>], top: f64) -> String {
    let mut svg = String::from(r##"<g class="legend" font-size="12" fill="#333">"##);
    for (index, row) in rows.iter().enumerate() {
        let y = top + index as f64 * LEGEND_ROW + LEGEND_ROW / 2.0;
        for &(x, label, colour) in row {
            let x = LEFT + x;
            let _ = write!(
                svg,
                r#"<line x1="{x:.1}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="{colour}" stroke-width="3"/><text x="{:.1}" y="{:.1}">{}</text>"#,
                x + 16.0,
                x + 22.0,
                y + 4.0,
                escape(label)
            );
        }
    }
    svg.push_str("</g>");
    svg
}

/// `text` with the characters that mean something in HTML and XML escaped.
pub fn escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => escaped.push_str("&amp;"),
            '<' => escaped.push_str("&lt;"),
            '>' => escaped.push_str("&gt;"),
            '"' => escaped.push_str("&quot;"),
            '\'' => escaped.push_str("&#39;"),
            c => escaped.push(c),
        }
    }
    escaped
}
