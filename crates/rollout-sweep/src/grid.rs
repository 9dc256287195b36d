//! The grid: `--grid key=v1,v2` axes, expanded (with seeds) into the sweep's runs, each with
//! its `--set` overrides, a readable name and a directory name.

use rollout_core::config::{KeyPath, Segment, parse_override_value};
use serde::{Deserialize, Serialize};

use crate::error::SweepError;

/// Keys the sweep sets itself, for every run.
const RESERVED: [&str; 2] = ["run.output_dir", "run.name"];
/// The key `--seeds` sets.
pub const SEED_KEY: &str = "run.seed";

/// One `--grid key=v1,v2,...`: a config key and the raw values (TOML syntax, as `--set`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Axis {
    pub key: String,
    pub values: Vec<String>,
}

/// One run of the sweep: its grid values (`(key, raw value)`, in axis order), its seed (with
/// `--seeds`), its name and the name of its directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Point {
    pub values: Vec<(String, String)>,
    pub seed: Option<u64>,
    pub name: String,
    pub dir_name: String,
}

impl Point {
    /// The `--set` assignments of this point's grid values and seed (not its name or
    /// directory, which the sweep adds).
    pub fn assignments(&self) -> Vec<String> {
        let mut sets: Vec<String> = self
            .values
            .iter()
            .map(|(key, value)| format!("{key}={value}"))
            .collect();
        if let Some(seed) = self.seed {
            sets.push(format!("{SEED_KEY}={seed}"));
        }
        sets
    }
}

/// Parses one `--grid` argument: `key=v1,v2`, values split at commas outside brackets,
/// braces and quotes (so `key=[1,2],[3]` has two values).
pub fn parse_axis(argument: &str) -> Result<Axis, SweepError> {
    let fail = |message: &str| SweepError::Grid {
        argument: argument.to_owned(),
        message: message.to_owned(),
    };
    let (key, raw) = argument
        .split_once('=')
        .ok_or_else(|| fail("expected `key.path=value1,value2,...`"))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(fail("the key path has an empty segment"));
    }
    if RESERVED.contains(&key) {
        return Err(fail("the sweep sets this key itself, for each run"));
    }
    let values = split_values(raw).map_err(|message| fail(&message))?;
    if values.iter().any(String::is_empty) {
        return Err(fail(
            "a value is empty (two commas in a row, or one at an end)",
        ));
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(twice) = values.iter().find(|v| !seen.insert(v.as_str())) {
        return Err(fail(&format!("the value `{twice}` is given twice")));
    }
    Ok(Axis {
        key: key.to_owned(),
        values,
    })
}

/// `raw` split at top-level commas, each part trimmed.
fn split_values(raw: &str) -> Result<Vec<String>, String> {
    let mut values = Vec::new();
    let mut current = String::new();
    let mut depth = 0i32;
    let mut quote: Option<char> = None;
    for c in raw.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '"' | '\'') => quote = Some(c),
            (None, '[' | '{') => depth += 1,
            (None, ']' | '}') => depth -= 1,
            (None, ',') if depth == 0 => {
                values.push(current.trim().to_owned());
                current.clear();
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    if quote.is_some() || depth != 0 {
        return Err("unbalanced quotes or brackets".into());
    }
    values.push(current.trim().to_owned());
    Ok(values)
}

/// Checks the axes together: each key once, and `run.seed` not both on the grid and from
/// `--seeds`.
pub fn check_axes(axes: &[Axis], seeds: Option<u64>) -> Result<(), SweepError> {
    for (index, axis) in axes.iter().enumerate() {
        let argument = format!("{}={}", axis.key, axis.values.join(","));
        if axes[..index].iter().any(|other| other.key == axis.key) {
            return Err(SweepError::Grid {
                argument,
                message: "this key has another --grid already".into(),
            });
        }
        if seeds.is_some() && axis.key == SEED_KEY {
            return Err(SweepError::Grid {
                argument,
                message: "--seeds sets run.seed: use one or the other".into(),
            });
        }
    }
    if seeds == Some(0) {
        return Err(SweepError::Grid {
            argument: "--seeds 0".into(),
            message: "at least one seed".into(),
        });
    }
    Ok(())
}

/// The cartesian product of the axes' values, the first axis varying slowest, times the
/// seeds `0..seeds` (innermost).
pub fn expand(axes: &[Axis], seeds: Option<u64>) -> Vec<Point> {
    let labels = labels(axes);
    let mut combinations: Vec<Vec<(String, String)>> = vec![Vec::new()];
    for axis in axes {
        combinations = combinations
            .into_iter()
            .flat_map(|prefix| {
                axis.values.iter().map(move |value| {
                    let mut next = prefix.clone();
                    next.push((axis.key.clone(), value.clone()));
                    next
                })
            })
            .collect();
    }
    let seed_list: Vec<Option<u64>> = match seeds {
        Some(count) => (0..count).map(Some).collect(),
        None => vec![None],
    };
    let mut points = Vec::with_capacity(combinations.len() * seed_list.len());
    for values in combinations {
        for seed in &seed_list {
            let name = point_name(&labels, &values, *seed);
            points.push(Point {
                values: values.clone(),
                seed: *seed,
                dir_name: dir_name(&name),
                name,
            });
        }
    }
    points
}

/// How each axis is named in run names: the key's last part (`learning_rate`), or the whole
/// key where two axes end alike.
fn labels(axes: &[Axis]) -> Vec<String> {
    let last = |key: &str| -> String {
        match KeyPath::parse_dotted(key).0.last() {
            Some(Segment::Key(name)) => name.clone(),
            _ => key.to_owned(),
        }
    };
    axes.iter()
        .map(|axis| {
            let short = last(&axis.key);
            let shared = axes
                .iter()
                .filter(|other| last(&other.key) == short)
                .count();
            if shared > 1 { axis.key.clone() } else { short }
        })
        .collect()
}

/// `learning_rate=1e-5,group_size=4,seed=1`: string values without their quotes.
fn point_name(labels: &[String], values: &[(String, String)], seed: Option<u64>) -> String {
    let mut parts: Vec<String> = labels
        .iter()
        .zip(values)
        .map(|(label, (_, raw))| {
            let shown = match parse_override_value(raw) {
                toml::Value::String(text) => text,
                _ => raw.clone(),
            };
            format!("{label}={shown}")
        })
        .collect();
    if let Some(seed) = seed {
        parts.push(format!("seed={seed}"));
    }
    if parts.is_empty() {
        "run".to_owned()
    } else {
        parts.join(",")
    }
}

/// `name` as a single directory name: characters other than letters, digits and
/// `=,.-_+` become `_`.
fn dir_name(name: &str) -> String {
    let cleaned: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "=,.-_+".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    if cleaned.starts_with('.') {
        format!("_{cleaned}")
    } else {
        cleaned
    }
}

/// Two points whose directory names collide (after cleaning) would share a directory.
pub fn check_unique(points: &[Point]) -> Result<(), SweepError> {
    let mut seen = std::collections::HashMap::new();
    for point in points {
        if let Some(other) = seen.insert(point.dir_name.as_str(), point.name.as_str()) {
            return Err(SweepError::Grid {
                argument: point.name.clone(),
                message: format!(
                    "runs `{other}` and `{}` would share the directory `{}`",
                    point.name, point.dir_name
                ),
            });
        }
    }
    Ok(())
}
