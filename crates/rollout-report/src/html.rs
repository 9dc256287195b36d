//! The page: one self-contained HTML file (inline CSS and SVG, no scripts, no fetches).

use std::fmt::Write;

use super::load::Run;
use super::phases::{Phase, share_bar, shares};
use super::scale::{format_duration, format_number};
use super::summary::RunFigures;
use super::svg::color;
use super::svg::escape;

const STYLE: &str = r#"
:root { color-scheme: light; }
body { margin: 0; background: #f5f6f8; color: #222;
  font-family: system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
header { background: #1f2a37; color: #fff; padding: 18px 28px; }
header h1 { margin: 0; font-size: 22px; font-weight: 600; }
header p { margin: 4px 0 0; color: #c9d1db; font-size: 13px; }
main { padding: 20px 28px 40px; max-width: 1400px; }
h2 { font-size: 17px; margin: 28px 0 10px; }
section.card, .charts > figure { background: #fff; border: 1px solid #e1e4e8; border-radius: 6px; }
section.card { padding: 4px 0; overflow-x: auto; }
table { border-collapse: collapse; font-size: 13px; width: 100%; }
th, td { padding: 6px 12px; text-align: right; white-space: nowrap; }
th { color: #555; font-weight: 600; border-bottom: 1px solid #e1e4e8; }
td:first-child, th:first-child, td.text, th.text { text-align: left; }
tr + tr td { border-top: 1px solid #f0f1f3; }
.swatch { display: inline-block; width: 11px; height: 11px; border-radius: 2px;
  margin-right: 7px; vertical-align: -1px; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 16px; }
.charts > figure { margin: 0; padding: 6px; }
svg.chart { display: block; width: 100%; height: auto; }
.note { color: #8a5a00; font-size: 12px; margin: 6px 0; }
footer { color: #888; font-size: 12px; margin-top: 28px; }
"#;

/// Everything the page shows, rendered.
pub struct Page<'a> {
    pub runs: &'a [Run],
    /// `<svg>` elements of the line charts.
    pub charts: &'a [String],
    /// `<svg>` elements of each run's phases (runs that logged none have none).
    pub phase_charts: &'a [String],
}

impl Page<'_> {
    pub fn render(&self) -> String {
        let names: Vec<&str> = self.runs.iter().map(|run| run.name.as_str()).collect();
        let title = format!("Rollout report: {}", names.join(", "));
        let mut html = String::with_capacity(64 * 1024);
        let _ = write!(
            html,
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
             <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
             <title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n",
            escape(&title)
        );
        let _ = write!(
            html,
            "<header><h1>{}</h1><p>{} from <code>metrics.jsonl</code>, written by <code>rollout report</code> {}</p></header>\n<main>\n",
            escape(&title),
            plural(self.runs.len(), "run"),
            env!("CARGO_PKG_VERSION")
        );
        html.push_str(&self.notes());
        html.push_str("<h2>Runs</h2>\n");
        html.push_str(&summary_table(self.runs));
        html.push_str("<h2>Training curves</h2>\n");
        html.push_str(&grid(self.charts));
        html.push_str("<h2>Where the time went</h2>\n");
        html.push_str(&share_table(self.runs));
        html.push_str(&grid(self.phase_charts));
        html.push_str(
            "<footer>Each chart's x axis is the RL step. Self-contained: no scripts, fonts or \
             network requests.</footer>\n</main>\n</body>\n</html>\n",
        );
        html
    }

    /// Warnings about the data, such as a skipped partial line.
    fn notes(&self) -> String {
        let mut html = String::new();
        for run in self.runs {
            if run.partial_last_line {
                let _ = writeln!(
                    html,
                    "<p class=\"note\">{}: the last line of metrics.jsonl was incomplete (still \
                     being written?) and was left out.</p>",
                    escape(&run.name)
                );
            }
            if run.steps.is_empty() {
                let _ = writeln!(
                    html,
                    "<p class=\"note\">{}: metrics.jsonl has no steps yet.</p>",
                    escape(&run.name)
                );
            }
        }
        html
    }
}

fn grid(charts: &[String]) -> String {
    let mut html = String::from("<div class=\"charts\">\n");
    for chart in charts {
        let _ = writeln!(html, "<figure>{chart}</figure>");
    }
    html.push_str("</div>\n");
    html
}

fn run_cell(index: usize, run: &Run) -> String {
    format!(
        "<td class=\"text\"><span class=\"swatch\" style=\"background:{}\"></span>{}</td>",
        color(index),
        escape(&run.name)
    )
}

fn summary_table(runs: &[Run]) -> String {
    let mut html = String::from(
        "<section class=\"card\"><table class=\"summary\">\n<tr><th>run</th><th>directory</th>\
         <th>status</th><th>steps</th><th>final reward</th><th>best reward (step)</th>\
         <th>samples/s</th><th>tokens/s</th><th>wall time</th></tr>\n",
    );
    for (index, run) in runs.iter().enumerate() {
        let figures = RunFigures::of(run);
        let steps = match (figures.last_step, figures.steps_planned) {
            (Some(last), Some(planned)) => format!("{} / {}", number(last), number(planned)),
            (Some(last), None) => number(last),
            (None, _) => "0".into(),
        };
        let best = figures.best_reward.map_or_else(
            || "–".into(),
            |(step, value)| format!("{} ({})", number(value), number(step)),
        );
        let _ = writeln!(
            html,
            "<tr>{}<td class=\"text\"><code>{}</code></td><td class=\"text\">{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            run_cell(index, run),
            escape(&run.dir.display().to_string()),
            figures.status,
            escape(&steps),
            optional(figures.final_reward),
            escape(&best),
            optional(figures.samples_per_second),
            optional(figures.tokens_per_second),
            figures
                .wall_seconds
                .map_or_else(|| "–".into(), format_duration),
        );
    }
    html.push_str("</table></section>\n");
    html
}

/// Each run's seconds by phase over the whole run: share, seconds and a bar.
fn share_table(runs: &[Run]) -> String {
    let per_run: Vec<Vec<(Phase, f64)>> = runs.iter().map(shares).collect();
    let mut columns: Vec<Phase> = Vec::new();
    for phase in per_run.iter().flatten().map(|(phase, _)| *phase) {
        if !columns.contains(&phase) {
            columns.push(phase);
        }
    }
    if columns.is_empty() {
        return "<p class=\"note\">No run logged its phases' seconds.</p>\n".into();
    }
    let mut html =
        String::from("<section class=\"card\"><table class=\"shares\">\n<tr><th>run</th>");
    for phase in &columns {
        let _ = write!(
            html,
            "<th><span class=\"swatch\" style=\"background:{}\"></span>{}</th>",
            phase.color,
            escape(phase.label)
        );
    }
    html.push_str(
        "<th>total</th><th class=\"text\">share</th>\
         <th title=\"checkpoint_blocked_seconds of summary.json\">checkpoint wait</th></tr>\n",
    );
    for (index, (run, shares)) in runs.iter().zip(&per_run).enumerate() {
        html.push_str(&share_row(index, run, shares, &columns));
    }
    html.push_str("</table></section>\n");
    html
}

/// One run's row of the share table: each phase's share and seconds, the total and a bar.
fn share_row(index: usize, run: &Run, shares: &[(Phase, f64)], columns: &[Phase]) -> String {
    let total: f64 = shares.iter().map(|(_, s)| s).sum();
    let mut html = format!("<tr>{}", run_cell(index, run));
    for phase in columns {
        let seconds = shares.iter().find(|(p, _)| p == phase).map(|(_, s)| *s);
        let cell = match seconds {
            Some(s) if total > 0.0 => format!(
                "{:.1}% <small>({})</small>",
                s / total * 100.0,
                format_duration(s)
            ),
            _ => "–".into(),
        };
        let _ = write!(html, "<td>{cell}</td>");
    }
    let ordered: Vec<(Phase, f64)> = columns
        .iter()
        .filter_map(|phase| shares.iter().find(|(p, _)| p == phase).copied())
        .filter(|(_, s)| *s > 0.0)
        .collect();
    let waited = run
        .summary
        .as_ref()
        .and_then(|s| s.checkpoint_blocked_seconds)
        .map_or_else(|| "–".into(), format_duration);
    let _ = writeln!(
        html,
        "<td>{}</td><td class=\"text\">{}</td><td>{waited}</td></tr>",
        format_duration(total),
        share_bar(&ordered)
    );
    html
}

fn number(value: f64) -> String {
    format_number(value)
}

fn optional(value: Option<f64>) -> String {
    value.map_or_else(|| "–".into(), |v| escape(&format_number(v)))
}

fn plural(count: usize, noun: &str) -> String {
    if count == 1 {
        format!("1 {noun}")
    } else {
        format!("{count} {noun}s")
    }
}
