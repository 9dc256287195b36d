//! `--trace FILE`: a Chrome trace of the process's `tracing` spans, which Perfetto
//! (<https://ui.perfetto.dev>) and `chrome://tracing` open.
//!
//! While the process runs, [`tracing_chrome`] writes every span (info level and above) to
//! FILE as a JSON array of nestable async events, one line each, flushed every second. At
//! exit, [`finish`] rewrites FILE as a trace object (`{"traceEvents": [...]}`): timestamps
//! become microseconds since the Unix epoch (so traces of several processes line up), events
//! carry the real process id and a process name, and each top-level span gets an async track
//! named after it (`step`, `rpc.generate`, ...), its child spans nested inside. A process
//! killed before it finished leaves the raw array, which the viewers open as it is.
//!
//! `rollout launch` starts its roles with `--trace` files of their own ([`child_path`]) and
//! merges them into its FILE at exit, so a distributed run gives one trace of all its
//! processes.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};
use tracing::Subscriber;
use tracing::level_filters::LevelFilter;
use tracing_chrome::{ChromeLayerBuilder, FlushGuard, TraceStyle};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::{FilterFn, filter_fn};
use tracing_subscriber::registry::LookupSpan;

/// The target of the one event the trace records besides spans: the clock anchor. Not a
/// module path, so that no log line of this module is taken for it (and hidden from the log).
const TARGET: &str = "rollout.trace.anchor";
/// The anchor's name: it maps the layer's clock onto the Unix epoch and names the process.
const CLOCK: &str = "rollout.trace.clock";
/// How often the spans written so far reach the file.
const FLUSH_EVERY: std::time::Duration = std::time::Duration::from_secs(1);
/// The category of every span: nestable async events nest only within one category.
const CATEGORY: &str = "rollout";

/// The trace this process is writing.
struct Active {
    guard: FlushGuard,
    path: PathBuf,
    process: String,
    /// Traces of the role processes `rollout launch` started, merged in at [`finish`].
    children: Vec<PathBuf>,
}

static ACTIVE: Mutex<Option<Active>> = Mutex::new(None);

fn active() -> std::sync::MutexGuard<'static, Option<Active>> {
    ACTIVE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What the log output keeps: no spans (they are the trace's), no clock anchor. Log lines
/// read the same with or without `--trace`.
pub fn log_filter() -> FilterFn<impl Fn(&tracing::Metadata<'_>) -> bool> {
    filter_fn(|meta| !meta.is_span() && meta.target() != TARGET)
        .with_max_level_hint(LevelFilter::TRACE)
}

/// Starts tracing into `path` (created, or truncated): the layer to add to the subscriber.
/// `process` names this process in the trace. Call [`anchor`] once the subscriber is set.
pub fn layer<S>(path: &Path, process: &str) -> std::io::Result<impl Layer<S> + use<S>>
where
    S: Subscriber + for<'span> LookupSpan<'span> + Send + Sync,
{
    let file = File::create(path).map_err(|err| {
        std::io::Error::new(
            err.kind(),
            format!("cannot create the trace file {}: {err}", path.display()),
        )
    })?;
    let (layer, guard) = ChromeLayerBuilder::new()
        .writer(file)
        .trace_style(TraceStyle::Async)
        .include_args(true)
        .include_locations(false)
        .category_fn(Box::new(|_| CATEGORY.into()))
        .build();
    *active() = Some(Active {
        guard,
        path: path.to_path_buf(),
        process: process.to_owned(),
        children: Vec::new(),
    });
    // The writer buffers; flushed every second, the file of a process killed outright
    // misses at most its last second.
    std::thread::Builder::new()
        .name("trace-flush".into())
        .spawn(|| {
            loop {
                std::thread::sleep(FLUSH_EVERY);
                match active().as_ref() {
                    Some(active) => active.guard.flush(),
                    None => break,
                }
            }
        })?;
    let recorded = filter_fn(|meta| {
        (meta.is_span() && *meta.level() <= tracing::Level::INFO) || meta.target() == TARGET
    })
    .with_max_level_hint(LevelFilter::INFO);
    Ok(layer.with_filter(recorded))
}

/// Records the clock anchor: the layer's timestamp of now next to the Unix time, the process
/// id and name. Without an anchor a trace cannot be lined up with other processes'.
pub fn anchor() {
    let Some(process) = active().as_ref().map(|a| a.process.clone()) else {
        return;
    };
    let unix_us = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1e6);
    tracing::info!(
        name: CLOCK,
        target: TARGET,
        unix_us,
        pid = std::process::id(),
        process = process.as_str()
    );
}

/// The trace file of role `name`, started by `rollout launch`, when this process writes a
/// trace: FILE with the name inserted (`T.json` -> `T.worker-0.json`; a role started again
/// gets `T.worker-0.2.json`, ...). It is merged into FILE at [`finish`].
pub fn child_path(name: &str) -> Option<PathBuf> {
    let mut guard = active();
    let active = guard.as_mut()?;
    let stem = active
        .path
        .file_stem()
        .map_or_else(|| "trace".into(), |s| s.to_string_lossy().into_owned());
    let extension = active
        .path
        .extension()
        .map(|e| format!(".{}", e.to_string_lossy()))
        .unwrap_or_default();
    let mut path = active
        .path
        .with_file_name(format!("{stem}.{name}{extension}"));
    let mut attempt = 1;
    while active.children.contains(&path) {
        attempt += 1;
        path = active
            .path
            .with_file_name(format!("{stem}.{name}.{attempt}{extension}"));
    }
    active.children.push(path.clone());
    Some(path)
}

/// A trace [`finish`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub path: PathBuf,
    /// Role processes' traces merged into it.
    pub merged: usize,
}

/// Flushes and closes the trace, rewrites it as a trace object and merges the role
/// processes' traces into it (`None` when not tracing, or already finished). Spans still
/// open are left without an end.
pub fn finish() -> std::io::Result<Option<Written>> {
    let Some(Active {
        guard,
        path,
        process,
        children,
    }) = active().take()
    else {
        return Ok(None);
    };
    // Stops the writer thread once it has written everything sent before: the file is a
    // complete JSON array.
    drop(guard);
    let text = std::fs::read_to_string(&path)?;
    let mut events = match parse(&text) {
        Parsed::Raw(raw) => normalize(raw, Some((std::process::id(), process.as_str()))),
        Parsed::Trace(events) => events,
    };
    let mut merged = 0;
    for child in &children {
        match std::fs::read_to_string(child) {
            Ok(text) => {
                merged += 1;
                events.extend(match parse(&text) {
                    Parsed::Raw(raw) => normalize(raw, None),
                    Parsed::Trace(events) => events,
                });
                if let Err(err) = std::fs::remove_file(child) {
                    tracing::warn!("cannot remove {} after merging it: {err}", child.display());
                }
            }
            Err(err) => tracing::warn!("no trace to merge from {}: {err}", child.display()),
        }
    }
    write_trace(&path, &events)?;
    Ok(Some(Written { path, merged }))
}

/// A trace file's events: as tracing-chrome wrote them, or already rewritten by [`finish`].
enum Parsed {
    Raw(Vec<Value>),
    Trace(Vec<Value>),
}

fn parse(text: &str) -> Parsed {
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Array(events)) => Parsed::Raw(events),
        Ok(Value::Object(mut trace)) => match trace.remove("traceEvents") {
            Some(Value::Array(events)) => Parsed::Trace(events),
            _ => Parsed::Trace(Vec::new()),
        },
        // Cut short (its process was killed): every whole line that is an event.
        _ => Parsed::Raw(
            text.lines()
                .filter_map(|line| serde_json::from_str(line.trim().trim_end_matches(',')).ok())
                .filter(Value::is_object)
                .collect(),
        ),
    }
}

/// Rewrites tracing-chrome's events of one process: timestamps since the Unix epoch, the
/// process's id and name (from `process`, else from the clock anchor), and the async ids
/// of top-level spans replaced by one id per span name and lane, so that each kind of
/// top-level span has tracks of its own (concurrent ones side by side) and ids never
/// collide across processes (`id2.local`).
fn normalize(raw: Vec<Value>, process: Option<(u32, &str)>) -> Vec<Value> {
    let clock = raw.iter().find(|e| e["name"] == CLOCK && e["ph"] == "i");
    let arg = |name: &str| clock.and_then(|e| number(&e["args"][name]));
    let offset = match (arg("unix_us"), clock.and_then(|e| e["ts"].as_f64())) {
        (Some(unix), Some(ts)) => unix - ts,
        _ => 0.0,
    };
    let (pid, name) = match process {
        Some((pid, name)) => (u64::from(pid), name.to_owned()),
        None => (
            arg("pid").map_or(0, |pid| pid as u64),
            clock
                .and_then(|e| e["args"]["process"].as_str())
                .map_or_else(|| "rollout".to_owned(), |s| s.trim_matches('"').to_owned()),
        ),
    };
    let mut events = Vec::with_capacity(raw.len() + 1);
    events.push(json!({
        "ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": { "name": name },
    }));
    let mut lanes = Lanes::default();
    for mut event in raw {
        let phase = event["ph"].as_str().unwrap_or_default().to_owned();
        match phase.as_str() {
            "b" | "e" => {
                let (Some(id), Some(span), Some(ts)) = (
                    event["id"].as_u64(),
                    event["name"].as_str().map(str::to_owned),
                    event["ts"].as_f64(),
                ) else {
                    continue;
                };
                let Some(cookie) = lanes.cookie(id, &span, phase == "b") else {
                    continue;
                };
                let mut out = json!({
                    "ph": phase, "name": span, "cat": CATEGORY, "ts": ts + offset,
                    "pid": pid, "tid": event["tid"], "id2": { "local": format!("0x{cookie:x}") },
                });
                if phase == "b" {
                    if let Some(Value::Object(args)) = event.get_mut("args").map(Value::take) {
                        out["args"] = Value::Object(typed(args));
                    }
                }
                events.push(out);
            }
            // The clock anchor.
            "i" => {}
            _ => {
                event["pid"] = json!(pid);
                events.push(event);
            }
        }
    }
    events
}

/// tracing-chrome writes every field as its `Debug` text: numbers, booleans and strings
/// become JSON values again.
fn typed(args: Map<String, Value>) -> Map<String, Value> {
    args.into_iter()
        .map(|(key, value)| {
            let value = match value.as_str().map(serde_json::from_str::<Value>) {
                Some(Ok(parsed @ (Value::Number(_) | Value::Bool(_) | Value::String(_)))) => parsed,
                _ => value,
            };
            (key, value)
        })
        .collect()
}

fn number(value: &Value) -> Option<f64> {
    value
        .as_f64()
        .or_else(|| value.as_str().and_then(|s| s.parse().ok()))
}

/// The async tracks of one process: a top-level span takes the first free lane of its
/// name; its descendants share its id.
#[derive(Default)]
struct Lanes {
    /// By tracing-chrome's id (the top-level span's): the track's id, the open spans under
    /// it, and the lane it holds.
    open: HashMap<u64, (u64, usize, String, usize)>,
    busy: HashMap<String, Vec<bool>>,
    ids: HashMap<(String, usize), u64>,
}

impl Lanes {
    fn cookie(&mut self, id: u64, name: &str, begin: bool) -> Option<u64> {
        if begin {
            if let Some((cookie, depth, ..)) = self.open.get_mut(&id) {
                *depth += 1;
                return Some(*cookie);
            }
            let busy = self.busy.entry(name.to_owned()).or_default();
            let lane = busy.iter().position(|b| !b).unwrap_or(busy.len());
            if lane == busy.len() {
                busy.push(true);
            } else {
                busy[lane] = true;
            }
            let next = self.ids.len() as u64 + 1;
            let cookie = *self.ids.entry((name.to_owned(), lane)).or_insert(next);
            self.open.insert(id, (cookie, 1, name.to_owned(), lane));
            return Some(cookie);
        }
        let (cookie, depth, ..) = self.open.get_mut(&id)?;
        let cookie = *cookie;
        *depth -= 1;
        if *depth == 0 {
            if let Some((_, _, root, lane)) = self.open.remove(&id) {
                if let Some(slot) = self.busy.get_mut(&root).and_then(|b| b.get_mut(lane)) {
                    *slot = false;
                }
            }
        }
        Some(cookie)
    }
}

/// Writes the trace object next to `path`, then moves it over `path`.
fn write_trace(path: &Path, events: &[Value]) -> std::io::Result<()> {
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    let mut out = BufWriter::new(File::create(&partial)?);
    out.write_all(b"{\"traceEvents\":[\n")?;
    for (index, event) in events.iter().enumerate() {
        if index > 0 {
            out.write_all(b",\n")?;
        }
        serde_json::to_writer(&mut out, event)?;
    }
    let other = json!({ "producer": format!("rollout {}", env!("CARGO_PKG_VERSION")) });
    write!(
        out,
        "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{other}}}\n"
    )?;
    out.into_inner()
        .map_err(|err| err.into_error())?
        .sync_all()?;
    std::fs::rename(&partial, path)
}

/// Writes out the `--trace` file, if any (and merges the traces of `rollout launch`'s
/// roles into it); on every way out of the process.
pub fn finish_and_log() {
    match finish() {
        Ok(Some(written)) => tracing::info!(
            "trace written to {}{} (open it in https://ui.perfetto.dev)",
            written.path.display(),
            match written.merged {
                0 => String::new(),
                merged => format!(", with the traces of {merged} role processes merged in"),
            }
        ),
        Ok(None) => {}
        Err(err) => eprintln!("warning: the trace could not be written: {err}"),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn raw(ph: &str, name: &str, id: u64, ts: f64) -> Value {
        json!({ "ph": ph, "pid": 1, "tid": 0, "ts": ts, "name": name, "cat": CATEGORY, "id": id,
                "args": { "step": "3", "kind": "\"train\"" } })
    }

    #[test]
    fn top_level_spans_get_a_track_per_name_and_lane_and_times_since_the_epoch() {
        let clock = json!({ "ph": "i", "pid": 1, "tid": 0, "ts": 10.0, "name": CLOCK,
            "args": { "unix_us": "1000010.5", "pid": "42", "process": "\"worker-0\"" } });
        let events = normalize(
            vec![
                clock,
                raw("b", "step", 1, 20.0),
                raw("b", "generate", 1, 21.0),
                // A second step overlapping the first, then the first ending.
                raw("b", "step", 5, 22.0),
                raw("e", "generate", 1, 23.0),
                raw("e", "step", 1, 24.0),
                raw("e", "step", 5, 25.0),
                // Id 1 reused for another kind of top-level span.
                raw("b", "checkpoint", 1, 26.0),
                raw("e", "checkpoint", 1, 27.0),
            ],
            None,
        );
        assert_eq!(events[0]["name"], "process_name");
        assert_eq!(events[0]["args"]["name"], "worker-0");
        assert!(events.iter().all(|e| e["pid"] == 42));
        let cookies: Vec<&str> = events[1..]
            .iter()
            .map(|e| e["id2"]["local"].as_str().unwrap())
            .collect();
        assert_eq!(
            cookies,
            ["0x1", "0x1", "0x2", "0x1", "0x1", "0x2", "0x3", "0x3"]
        );
        assert_eq!(events[1]["ts"], 1000020.5);
        assert_eq!(events[1]["args"]["step"], 3);
        assert_eq!(events[1]["args"]["kind"], "train");
        assert!(events[4].get("args").is_none());
    }

    #[test]
    fn a_trace_cut_short_keeps_its_whole_lines() {
        let text =
            "[\n{\"ph\":\"b\",\"id\":1,\"name\":\"step\",\"ts\":1.0},\n{\"ph\":\"e\",\"id\":1,\"na";
        let Parsed::Raw(events) = parse(text) else {
            panic!("a raw trace");
        };
        assert_eq!(events.len(), 1);
        assert!(matches!(
            parse("{\"traceEvents\":[{\"ph\":\"M\"}]}"),
            Parsed::Trace(events) if events.len() == 1
        ));
    }
}
