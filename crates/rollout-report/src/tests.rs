#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use super::line::{LineChart, Series, band_path, line_path, smooth};
use super::phases::{OTHER, phase_steps, shares};
use super::scale::{Scale, format_duration, format_number, nice_domain, nice_step};
use super::svg::Plot;
use super::*;

fn metrics_line(step: u64, reward: f64) -> String {
    serde_json::json!({
        "step": step,
        "reward_mean": reward,
        "reward_std": 0.1,
        "loss": -0.01 * step as f64,
        "completion_length_mean": 3.5,
        "completions": 8,
        "generated_tokens": 28,
        "samples_per_second": 8.0,
        "tokens_per_second": 28.0,
        "generate_seconds": 0.5,
        "score_seconds": 0.1,
        "train_seconds": 0.3,
        "weight_sync_seconds": 0.0,
        "step_seconds": 1.0,
        "engine/kv_blocks": 12,
        "epoch": 0,
        "weight_version": step,
        "elapsed_seconds": step as f64,
    })
    .to_string()
}

fn run_dir(root: &Path, name: &str, rewards: &[f64], tail: &str) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let mut text: String = rewards
        .iter()
        .enumerate()
        .map(|(i, r)| metrics_line(i as u64 + 1, *r) + "\n")
        .collect();
    text.push_str(tail);
    std::fs::write(dir.join("metrics.jsonl"), text).unwrap();
    dir
}

fn plot() -> Plot {
    Plot {
        x: Scale::new(0.0, 10.0, 0.0, 100.0),
        y: Scale::new(0.0, 1.0, 50.0, 0.0),
    }
}

#[test]
fn parses_numbers_and_skips_a_partial_last_line() {
    let text = format!(
        "{}\n{}\n{{\"step\": 3, \"rew",
        metrics_line(1, 0.2),
        metrics_line(2, 0.4)
    );
    let (steps, partial) = parse_metrics(&text, Path::new("m.jsonl")).unwrap();
    assert!(partial);
    assert_eq!(steps.len(), 2);
    assert_eq!(steps[1].0, 2.0);
    assert_eq!(steps[1].1["reward_mean"], 0.4);
    assert_eq!(steps[0].1["engine/kv_blocks"], 12.0);
    // A line that is JSON but not a step's metrics is as broken as one that is not JSON.
    let text = format!(
        "{}\n{{\"step\": \"one\"}}\n{}",
        metrics_line(1, 0.2),
        metrics_line(2, 0.4)
    );
    let err = parse_metrics(&text, Path::new("m.jsonl")).unwrap_err();
    assert!(err.to_string().starts_with("m.jsonl:2:"), "{err}");
}

#[test]
fn a_broken_line_before_the_last_is_an_error_with_its_line() {
    let text = format!(
        "{}\nnot json\n{}\n",
        metrics_line(1, 0.2),
        metrics_line(2, 0.4)
    );
    let err = parse_metrics(&text, Path::new("m.jsonl")).unwrap_err();
    assert!(err.to_string().starts_with("m.jsonl:2:"), "{err}");
}

#[test]
fn a_step_logged_twice_keeps_its_last_line_and_steps_are_ordered() {
    let text = [
        metrics_line(2, 0.1),
        metrics_line(1, 0.2),
        metrics_line(2, 0.9),
    ]
    .join("\n");
    let (steps, partial) = parse_metrics(&text, Path::new("m.jsonl")).unwrap();
    assert!(!partial);
    let rewards: Vec<(f64, f64)> = steps.iter().map(|(s, m)| (*s, m["reward_mean"])).collect();
    assert_eq!(rewards, vec![(1.0, 0.2), (2.0, 0.9)]);
}

#[test]
fn a_directory_without_metrics_is_an_error_naming_the_file() {
    let root = tempfile::tempdir().unwrap();
    let err = load_run(root.path()).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains(&root.path().join("metrics.jsonl").display().to_string()),
        "{message}"
    );
    assert!(message.contains("output directory"), "{message}");
}

#[test]
fn runs_are_named_by_summary_then_config_then_directory() {
    let root = tempfile::tempdir().unwrap();
    let a = run_dir(root.path(), "a", &[0.1], "");
    std::fs::write(
        a.join("summary.json"),
        r#"{"name": "alpha", "wall_seconds": 12.5}"#,
    )
    .unwrap();
    let b = run_dir(root.path(), "b", &[0.1], "");
    std::fs::write(b.join("config.toml"), "[run]\nname = \"beta\"\n").unwrap();
    let c = run_dir(root.path(), "c", &[0.1], "");
    let runs = load_runs(&[a, b, c]).unwrap();
    let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names, ["alpha", "beta", "c"]);
    assert_eq!(runs[0].summary.as_ref().unwrap().wall_seconds, Some(12.5));
}

#[test]
fn runs_with_the_same_name_are_told_apart_by_directory() {
    let root = tempfile::tempdir().unwrap();
    let a = run_dir(root.path(), "a", &[0.1], "");
    let b = run_dir(root.path(), "b", &[0.1], "");
    for dir in [&a, &b] {
        std::fs::write(dir.join("config.toml"), "[run]\nname = \"e2e\"\n").unwrap();
    }
    let runs = load_runs(&[a.clone(), b]).unwrap();
    assert_ne!(runs[0].name, runs[1].name);
    assert_eq!(runs[0].name, format!("e2e ({})", a.display()));
}

#[test]
fn ticks_are_round_and_cover_the_data() {
    assert_eq!(nice_step(0.13), 0.2);
    assert_eq!(nice_step(2.2), 2.5);
    assert_eq!(nice_step(700.0), 1000.0);
    let (low, high, ticks) = nice_domain(0.12, 0.93, 5);
    assert!(low <= 0.12 && high >= 0.93);
    assert_eq!(ticks, vec![0.0, 0.2, 0.4, 0.6, 0.8, 1.0]);
    let (low, high, ticks) = nice_domain(5.0, 5.0, 5);
    assert!(low < 5.0 && high > 5.0 && ticks.len() >= 2);
    let (_, _, ticks) = nice_domain(f64::NAN, f64::NAN, 5);
    assert_eq!(ticks.first(), Some(&0.0));
}

#[test]
fn scale_maps_linearly_and_upwards_for_y() {
    let y = Scale::new(0.0, 2.0, 300.0, 100.0);
    assert_eq!(y.map(0.0), 300.0);
    assert_eq!(y.map(1.0), 200.0);
    assert_eq!(y.map(2.0), 100.0);
    assert_eq!(Scale::new(1.0, 1.0, 0.0, 10.0).map(1.0), 5.0);
}

#[test]
fn numbers_and_durations_read_well() {
    assert_eq!(format_number(0.30000000000000004), "0.3");
    assert_eq!(format_number(1254.79), "1255");
    assert_eq!(format_number(351.46), "351.5");
    assert_eq!(format_number(35_140.0), "35.14k");
    assert_eq!(format_number(2.5e6), "2.5M");
    assert_eq!(format_number(0.00005), "5e-5");
    assert_eq!(format_number(-0.0), "0");
    assert_eq!(format_duration(42.12), "42.1 s");
    assert_eq!(format_duration(200.0), "3 min 20 s");
    assert_eq!(format_duration(7500.0), "2 h 5 min");
}

#[test]
fn line_and_band_paths() {
    let plot = plot();
    assert_eq!(
        line_path(&[(0.0, 0.0), (5.0, 1.0), (10.0, 0.5)], &plot),
        "M0.0,50.0L50.0,0.0L100.0,25.0"
    );
    assert_eq!(line_path(&[], &plot), "");
    let band = band_path(&[(0.0, 0.0, 1.0), (10.0, 0.5, 1.0)], &plot);
    assert_eq!(band, "M0.0,0.0L100.0,0.0L100.0,25.0L0.0,50.0Z");
}

#[test]
fn smoothing_is_an_unbiased_moving_average() {
    let points = [(1.0, 1.0), (2.0, 1.0), (3.0, 1.0)];
    for (_, value) in smooth(&points, 0.9) {
        assert!((value - 1.0).abs() < 1e-12);
    }
    let step = smooth(&[(1.0, 0.0), (2.0, 1.0)], 0.5);
    assert!((step[1].1 - 2.0 / 3.0).abs() < 1e-12);
    assert_eq!(smooth(&points, 0.0), points.to_vec());
}

#[test]
fn a_chart_has_one_series_per_run_with_axes_and_legend() {
    let series = |label: &str, color: &str| Series {
        label: label.into(),
        color: color.into(),
        points: vec![(1.0, 0.1), (2.0, 0.5), (3.0, 0.4)],
        raw: None,
        band: vec![(1.0, 0.0, 0.2), (2.0, 0.4, 0.6), (3.0, 0.3, 0.5)],
    };
    let chart = LineChart {
        id: "reward".into(),
        title: "Reward <mean>".into(),
        subtitle: None,
        y_label: "reward_mean".into(),
        y_from_zero: false,
        series: vec![series("a", "#111111"), series("b & c", "#222222")],
    };
    let svg = chart.render();
    assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
    assert_eq!(svg.matches("class=\"series\"").count(), 2);
    assert_eq!(svg.matches("class=\"band\"").count(), 2);
    assert!(svg.contains("Reward &lt;mean&gt;"));
    assert!(svg.contains("b &amp; c"), "legend entries are escaped");
    assert!(svg.contains(">step</text>") && svg.contains(">reward_mean</text>"));
    assert!(svg.contains("class=\"legend\""));
}

#[test]
fn phases_stack_up_to_the_step_time() {
    let root = tempfile::tempdir().unwrap();
    let dir = run_dir(root.path(), "a", &[0.1, 0.2], "");
    std::fs::write(
        dir.join("summary.json"),
        r#"{"checkpoint_blocked_seconds": 0.05}"#,
    )
    .unwrap();
    let run = load_run(&dir).unwrap();
    let steps = phase_steps(&run).unwrap();
    let labels: Vec<&str> = steps.phases.iter().map(|p| p.label).collect();
    assert_eq!(
        labels,
        ["generate", "score", "train", "weight sync", "other"]
    );
    let total: f64 = steps.steps[0].1.iter().sum();
    assert!((total - 1.0).abs() < 1e-9);
    let shares = shares(&run);
    let other = shares.iter().find(|(p, _)| *p == OTHER).unwrap().1;
    assert!((other - 0.2).abs() < 1e-9, "{shares:?}");
    let total: f64 = shares.iter().map(|(_, s)| s).sum();
    assert!(
        (total - 2.0).abs() < 1e-9,
        "the phases add up to the steps' seconds"
    );
    let html = render(&[run], 0.0).html;
    assert!(
        html.contains("checkpoint wait</th>"),
        "the summary's checkpoint wait is shown"
    );
}

#[test]
fn the_page_overlays_every_run_and_is_self_contained() {
    let root = tempfile::tempdir().unwrap();
    let a = run_dir(root.path(), "a", &[0.1, 0.3, 0.5], "{\"step\": 4, ");
    let b = run_dir(root.path(), "b", &[0.2, 0.2, 0.4], "");
    let runs = load_runs(&[a.clone(), b]).unwrap();
    let report = render(&runs, 0.5);
    let ids: Vec<&str> = report.charts.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "reward",
            "loss",
            "length",
            "samples_per_second",
            "tokens_per_second",
            "phases-1",
            "phases-2"
        ]
    );
    for (id, svg) in &report.charts {
        if !id.starts_with("phases") {
            assert_eq!(svg.matches("class=\"series\"").count(), 2, "{id}");
            assert_eq!(svg.matches("class=\"raw\"").count(), 2, "{id}: smoothed");
        }
    }
    assert_eq!(
        report.html.matches("<svg").count() - report.html.matches("share-bar").count(),
        7
    );
    assert!(!report.html.contains("<script"));
    assert!(!report.html.contains("src=") && !report.html.contains("href="));
    assert!(
        report.html.contains("incomplete"),
        "the partial line is noted"
    );
    let written = write(&Options {
        run_dirs: vec![a.clone()],
        output: None,
        smoothing: 0.0,
    })
    .unwrap();
    assert_eq!(written.html, a.join("report.html"));
    assert!(
        std::fs::read_to_string(&written.html)
            .unwrap()
            .starts_with("<!DOCTYPE html>")
    );
}

#[test]
fn bad_options_are_refused() {
    let err = write(&Options {
        run_dirs: vec![PathBuf::from("/nonexistent/run")],
        output: None,
        smoothing: 1.5,
    })
    .unwrap_err();
    assert!(matches!(err, ReportError::Smoothing(_)));
    let err = write(&Options::default()).unwrap_err();
    assert!(matches!(err, ReportError::NoRuns));
}

#[test]
fn a_multi_agent_run_gets_a_line_per_agent() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("agents");
    std::fs::create_dir_all(&dir).unwrap();
    let lines: String = (1..=3)
        .map(|step| {
            let line = serde_json::json!({
                "step": step,
                "reward_mean": 0.5,
                "proposer/reward_mean": 0.1 * f64::from(step),
                "solver/reward_mean": 0.2 * f64::from(step),
                "solver/loss": -0.5,
                "epoch": 0,
                "weight_version": step,
                "step_seconds": 1.0,
                "elapsed_seconds": f64::from(step),
            });
            format!("{line}\n")
        })
        .collect();
    std::fs::write(dir.join("metrics.jsonl"), lines).unwrap();
    let runs = load_runs(&[dir]).unwrap();
    let charts = agents::agent_charts(&runs, 0.0);
    let ids: Vec<&str> = charts.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, ["agents_reward", "agents_loss"]);
    let reward = &charts[0];
    let labels: Vec<&str> = reward.series.iter().map(|s| s.label.as_str()).collect();
    assert_eq!(labels, ["proposer", "solver"]);
    assert_eq!(
        reward.series[1].points,
        [(1.0, 0.2), (2.0, 0.4), (3.0, 0.6000000000000001)]
    );
    assert_ne!(reward.series[0].color, reward.series[1].color);
    assert_eq!(charts[1].series.len(), 1, "only the solver logged a loss");
    assert!(render(&runs, 0.0).html.contains("Reward per agent"));
    // A single-policy run has no per-agent chart.
    let single = run_dir(root.path(), "single", &[0.1, 0.2], "");
    assert!(agents::agent_charts(&load_runs(&[single]).unwrap(), 0.0).is_empty());
}

#[test]
fn every_chart_and_figure_reads_a_field_of_the_metrics_schema_or_a_policy_measurement() {
    let fields: Vec<&str> = rollout_core::metrics::StepMetrics::FIELDS
        .iter()
        .map(|field| field.name)
        .collect();
    // Training metrics the built-in policy reports (in `measured`).
    let measured = ["kl", "value_loss"];
    let charted = charts::DEFINITIONS
        .iter()
        .map(|definition| definition.metric)
        .chain(agents::AGENT_CHARTS.iter().map(|(metric, ..)| *metric))
        .chain(phases::PHASES.iter().filter_map(|phase| phase.key))
        // What the summary table (and `rollout sweep`'s) reads.
        .chain([
            "step_seconds",
            "elapsed_seconds",
            "completions",
            "generated_tokens",
            "samples_per_second",
            "tokens_per_second",
        ]);
    for metric in charted {
        assert!(
            fields.contains(&metric) || measured.contains(&metric),
            "`{metric}` is charted but is not a field of StepMetrics"
        );
    }
}
