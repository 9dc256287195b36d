#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use resvg::tiny_skia::Pixmap;
use resvg::usvg::fontdb;

use super::png::{Rasterizer, SCALE, default_dir};
use super::svg::color;
use super::*;

/// A run directory with `rewards.len()` steps of metrics.
fn run_dir(root: &Path, name: &str, rewards: &[f64]) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let lines: String = rewards
        .iter()
        .enumerate()
        .map(|(i, reward)| {
            let line = serde_json::json!({
                "step": i + 1,
                "reward_mean": reward,
                "loss": 0.1 * i as f64,
                "generate_seconds": 0.5,
                "train_seconds": 0.3,
                "step_seconds": 1.0,
                "epoch": 0,
                "weight_version": i + 1,
                "elapsed_seconds": i as f64 + 1.0,
            });
            format!("{line}\n")
        })
        .collect();
    std::fs::write(dir.join("metrics.jsonl"), lines).unwrap();
    dir
}

/// Two runs' report: `(id, svg)` of each chart.
fn charts(root: &Path) -> Vec<(String, String)> {
    let a = run_dir(root, "a", &[0.1, 0.6, 0.2, 0.9]);
    let b = run_dir(root, "b", &[0.5, 0.3, 0.8, 0.4]);
    render(&load_runs(&[a, b]).unwrap(), 0.0).charts
}

/// The `width` and `height` attributes of the `<svg>`.
fn svg_size(svg: &str) -> (f32, f32) {
    let attribute = |name: &str| -> f32 {
        let start = svg.find(&format!(" {name}=\"")).unwrap() + name.len() + 3;
        let end = start + svg[start..].find('"').unwrap();
        svg[start..end].parse().unwrap()
    };
    (attribute("width"), attribute("height"))
}

/// Pixels within `tolerance` of the colour `#rrggbb` on each channel.
fn pixels_near(pixmap: &Pixmap, hex: &str, tolerance: u8) -> usize {
    let value = u32::from_str_radix(hex.trim_start_matches('#'), 16).unwrap();
    let [_, r, g, b] = value.to_be_bytes();
    pixmap
        .pixels()
        .iter()
        .filter(|p| p.alpha() == 255)
        .filter(|p| {
            p.red().abs_diff(r) <= tolerance
                && p.green().abs_diff(g) <= tolerance
                && p.blue().abs_diff(b) <= tolerance
        })
        .count()
}

/// Dark pixels, as text (#222, #333, #555) draws them: the axes and grid are lighter.
fn dark_pixels(pixmap: &Pixmap) -> usize {
    pixmap
        .pixels()
        .iter()
        .filter(|p| p.red() < 0x70 && p.green() < 0x70 && p.blue() < 0x70)
        .count()
}

#[test]
fn a_chart_renders_at_twice_its_size_with_each_runs_line_in_its_colour() {
    let root = tempfile::tempdir().unwrap();
    let charts = charts(root.path());
    let (_, svg) = charts.iter().find(|(id, _)| id == "reward").unwrap();
    let (width, height) = svg_size(svg);
    let png = Rasterizer::with_system_fonts().png(svg).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let pixmap = Pixmap::decode_png(&png).unwrap();
    assert_eq!(
        (pixmap.width(), pixmap.height()),
        ((width * SCALE) as u32, (height * SCALE) as u32)
    );
    for run in 0..2 {
        // Two lines of 3 steps each, 4 pixels wide, plus the legend's swatch.
        let count = pixels_near(&pixmap, color(run), 6);
        assert!(count > 1500, "run {run}: {count} pixels of {}", color(run));
    }
    assert!(pixels_near(&pixmap, "#ffffff", 0) > pixmap.pixels().len() / 2);
}

#[test]
fn without_fonts_the_lines_are_still_drawn_and_with_them_the_labels() {
    let root = tempfile::tempdir().unwrap();
    let charts = charts(root.path());
    let (_, svg) = charts.iter().find(|(id, _)| id == "reward").unwrap();
    let bare = Rasterizer::with_fonts(fontdb::Database::new());
    assert_eq!(bare.font_faces(), 0);
    let without = bare.pixmap(svg).unwrap();
    assert!(pixels_near(&without, color(0), 6) > 1500);
    assert!(pixels_near(&without, color(1), 6) > 1500);
    let system = Rasterizer::with_system_fonts();
    if system.font_faces() == 0 {
        eprintln!("no system fonts: the labels cannot be checked here");
        return;
    }
    let with = system.pixmap(svg).unwrap();
    // The title, tick labels, axis labels and legend: thousands of dark pixels.
    let (dark_with, dark_without) = (dark_pixels(&with), dark_pixels(&without));
    assert!(
        dark_with > dark_without + 2000,
        "{dark_with} dark pixels with fonts, {dark_without} without"
    );
}

#[test]
fn write_with_png_writes_every_chart_beside_the_page_or_in_a_directory() {
    let root = tempfile::tempdir().unwrap();
    let run = run_dir(root.path(), "a", &[0.1, 0.4, 0.3]);
    let options = Options {
        run_dirs: vec![run.clone()],
        output: None,
        smoothing: 0.0,
    };
    let written = write_with_png(&options, &PngOutput::NextToPage).unwrap();
    assert_eq!(written.pngs.len(), written.charts.len());
    for (id, path) in written.charts.iter().zip(&written.pngs) {
        assert_eq!(path, &run.join("report_files").join(format!("{id}.png")));
        let pixmap = Pixmap::decode_png(&std::fs::read(path).unwrap()).unwrap();
        assert_eq!(pixmap.width(), 1280, "{id}");
    }
    let elsewhere = root.path().join("pngs");
    let written = write_with_png(&options, &PngOutput::Dir(elsewhere.clone())).unwrap();
    assert!(
        written
            .pngs
            .iter()
            .all(|path| path.parent() == Some(&*elsewhere))
    );
    assert!(write(&options).unwrap().pngs.is_empty());
}

#[test]
fn the_default_png_directory_is_named_after_the_page() {
    assert_eq!(
        default_dir(Path::new("runs/a/R.html")),
        Path::new("runs/a/R_files")
    );
    assert_eq!(
        default_dir(Path::new("report.html")),
        Path::new("report_files")
    );
}

#[test]
fn an_svg_that_does_not_parse_is_an_error() {
    let err = Rasterizer::with_fonts(fontdb::Database::new())
        .png("<svg")
        .unwrap_err();
    assert!(matches!(err, png::PngError::Svg(_)), "{err}");
}
