//! Axes: a linear map from data to pixels, with round tick values and their labels.

/// A linear scale from the data interval `[min, max]` to the pixel interval `[from, to]`
/// (`to < from` for a y axis, which grows upwards).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scale {
    pub min: f64,
    pub max: f64,
    pub from: f64,
    pub to: f64,
}

impl Scale {
    pub fn new(min: f64, max: f64, from: f64, to: f64) -> Scale {
        Scale { min, max, from, to }
    }

    /// The pixel of `value` (values outside the domain map outside the range).
    pub fn map(&self, value: f64) -> f64 {
        let span = self.max - self.min;
        if span == 0.0 || !span.is_finite() {
            return (self.from + self.to) / 2.0;
        }
        self.from + (value - self.min) / span * (self.to - self.from)
    }
}

/// The interval to draw for data spanning `[min, max]`, extended to round tick values, and
/// the ticks (about `target` of them). A single value gets an interval around it.
pub fn nice_domain(min: f64, max: f64, target: usize) -> (f64, f64, Vec<f64>) {
    let (mut min, mut max) = if min.is_finite() && max.is_finite() && min <= max {
        (min, max)
    } else {
        (0.0, 1.0)
    };
    if min == max {
        let pad = if min == 0.0 { 1.0 } else { min.abs() * 0.1 };
        min -= pad;
        max += pad;
    }
    let step = nice_step((max - min) / target.max(1) as f64);
    let low = (min / step).floor() * step;
    let high = (max / step).ceil() * step;
    let count = ((high - low) / step).round() as usize;
    let ticks = (0..=count)
        .map(|i| clean(low + i as f64 * step, step))
        .collect();
    (low, high, ticks)
}

/// 1, 2, 2.5 or 5 times a power of ten, at least `raw`.
pub fn nice_step(raw: f64) -> f64 {
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    let power = 10f64.powf(raw.log10().floor());
    let fraction = raw / power;
    let nice = if fraction <= 1.0 {
        1.0
    } else if fraction <= 2.0 {
        2.0
    } else if fraction <= 2.5 {
        2.5
    } else if fraction <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * power
}

/// `value` rounded to a tenth of `step`, so that 0.30000000000000004 prints as 0.3.
fn clean(value: f64, step: f64) -> f64 {
    let unit = step / 10.0;
    let rounded = (value / unit).round() * unit;
    if rounded.abs() < unit / 2.0 {
        0.0
    } else {
        rounded
    }
}

/// A short label for a number: `12k`, `3.5M`, `0.25`, `1e-5`.
pub fn format_number(value: f64) -> String {
    if !value.is_finite() {
        return "–".into();
    }
    let magnitude = value.abs();
    if magnitude == 0.0 {
        return "0".into();
    }
    if magnitude >= 1e9 {
        return format!("{}G", trim(value / 1e9, 2));
    }
    if magnitude >= 1e6 {
        return format!("{}M", trim(value / 1e6, 2));
    }
    if magnitude >= 1e4 {
        return format!("{}k", trim(value / 1e3, 2));
    }
    if magnitude < 1e-3 {
        return format!("{value:.1e}").replace(".0e", "e");
    }
    let decimals = (3 - magnitude.log10().floor() as i32).clamp(0, 5) as usize;
    trim(value, decimals)
}

/// `value` with at most `decimals` decimals, without trailing zeros.
fn trim(value: f64, decimals: usize) -> String {
    let text = format!("{value:.decimals$}");
    let text = if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        text
    };
    if text == "-0" { "0".into() } else { text }
}

/// Seconds as `42.1 s`, `3 min 20 s` or `2 h 5 min`.
pub fn format_duration(seconds: f64) -> String {
    if !seconds.is_finite() {
        return "–".into();
    }
    if seconds < 60.0 {
        return format!("{seconds:.1} s");
    }
    let whole = seconds.round() as u64;
    if whole < 3600 {
        return format!("{} min {} s", whole / 60, whole % 60);
    }
    format!("{} h {} min", whole / 3600, (whole % 3600) / 60)
}
