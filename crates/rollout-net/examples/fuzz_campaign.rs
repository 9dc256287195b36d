//! The long fuzz campaign of issue 9's chaos suite: random and mutated inputs through the frame
//! decoder, every message kind's parse and both sides of the handshake, all in memory. The CI
//! cases are `tests/fuzz_wire.rs`, which shares the targets.
//!
//! ```text
//! cargo run --release -p rollout-net --example fuzz_campaign -- --inputs 1000000 --seed 1 [--jobs 2]
//! ```
//!
//! Prints one JSON line to stdout (`fuzz_inputs`, `fuzz_panics`, `largest_allocation_bytes`,
//! `allocation_bound_bytes`, `seconds`) and a breakdown to stderr. Exits with 1 on a panic, an
//! allocation over the bound (the decoder's configured maximum frame size) or another broken
//! property, with the first failing inputs on stderr; 2 on bad arguments.

#[path = "../tests/fuzz_support/mod.rs"]
mod fuzz_support;

use std::backtrace::Backtrace;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::panic::{self, AssertUnwindSafe};
use std::process::ExitCode;
use std::time::Instant;

use fuzz_support::{ALLOCATION_BOUND, CountingAlloc, Fixture, Input, measure};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::Serialize;
use tokio::runtime::{Builder, Runtime};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// Failures described in full on stderr; the rest are only counted.
const REPORTED_FAILURES: usize = 5;

struct Args {
    inputs: u64,
    seed: u64,
    jobs: u64,
}

fn parse_args() -> Result<Args, String> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut args = Args {
        inputs: 1_000_000,
        seed: 1,
        jobs: u64::try_from(cores).unwrap_or(1),
    };
    let mut words = std::env::args().skip(1);
    while let Some(flag) = words.next() {
        let value = words
            .next()
            .ok_or_else(|| format!("{flag} needs a value"))?;
        let number = value
            .parse::<u64>()
            .map_err(|err| format!("{flag} {value}: {err}"))?;
        match flag.as_str() {
            "--inputs" => args.inputs = number,
            "--seed" => args.seed = number,
            "--jobs" => args.jobs = number.max(1),
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    Ok(args)
}

#[derive(Serialize)]
struct Report {
    fuzz_inputs: u64,
    fuzz_panics: u64,
    largest_allocation_bytes: usize,
    allocation_bound_bytes: usize,
    seconds: f64,
}

/// What the workers saw.
#[derive(Default)]
struct Tally {
    inputs: u64,
    panics: u64,
    violations: u64,
    over_bound: u64,
    largest: usize,
    paths: BTreeMap<&'static str, u64>,
    failures: Vec<String>,
}

impl Tally {
    fn fail(&mut self, fixture: &Fixture, input: &Input, why: &str) {
        if self.failures.len() < REPORTED_FAILURES {
            let wire: String = fixture
                .wire_bytes(input)
                .iter()
                .map(|byte| format!("{byte:02x}"))
                .collect();
            self.failures
                .push(format!("input {input:?}\nits bytes (hex) {wire}\n{why}"));
        }
    }

    fn merge(&mut self, other: Tally) {
        self.inputs += other.inputs;
        self.panics += other.panics;
        self.violations += other.violations;
        self.over_bound += other.over_bound;
        self.largest = self.largest.max(other.largest);
        for (path, count) in other.paths {
            *self.paths.entry(path).or_default() += count;
        }
        let room = REPORTED_FAILURES.saturating_sub(self.failures.len());
        self.failures.extend(other.failures.into_iter().take(room));
    }
}

thread_local! {
    /// The last panic on this thread: its message and location, and where it happened.
    static LAST_PANIC: RefCell<Option<(String, Backtrace)>> = const { RefCell::new(None) };
}

fn new_runtime() -> Result<Runtime, String> {
    Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|err| format!("cannot start a runtime: {err}"))
}

/// Runs `inputs` random inputs drawn from `seed`.
fn work(fixture: &Fixture, seed: u64, inputs: u64) -> Result<Tally, String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut runtime = new_runtime()?;
    let mut tally = Tally::default();
    for _ in 0..inputs {
        let input = fixture.random_input(&mut rng);
        let run = || panic::catch_unwind(AssertUnwindSafe(|| fixture.run(&input, &runtime)));
        let (outcome, largest) = measure(run);
        tally.inputs += 1;
        *tally.paths.entry(input.path()).or_default() += 1;
        tally.largest = tally.largest.max(largest);
        if largest > ALLOCATION_BOUND {
            tally.over_bound += 1;
            tally.fail(
                fixture,
                &input,
                &format!("a single allocation of {largest} bytes"),
            );
        }
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(violation)) => {
                tally.violations += 1;
                tally.fail(fixture, &input, &violation);
            }
            Err(_) => {
                tally.panics += 1;
                let report = LAST_PANIC.take().map_or_else(
                    || "a panic".to_string(),
                    |(message, trace)| format!("{message}\n{trace}"),
                );
                tally.fail(fixture, &input, &report);
                // A runtime a panic went through is not trusted again.
                runtime = new_runtime()?;
            }
        }
    }
    Ok(tally)
}

/// Splits the inputs over `jobs` threads, each drawing from its own seed.
fn campaign(fixture: &Fixture, args: &Args) -> Result<Tally, String> {
    let results: Vec<Result<Tally, String>> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..args.jobs)
            .map(|job| {
                let share = args.inputs / args.jobs + u64::from(job < args.inputs % args.jobs);
                let seed = args.seed ^ job.wrapping_mul(0x9e37_79b9_7f4a_7c15);
                scope.spawn(move || work(fixture, seed, share))
            })
            .collect();
        workers
            .into_iter()
            .map(|worker| {
                worker
                    .join()
                    .unwrap_or_else(|_| Err("a worker panicked outside an input".into()))
            })
            .collect()
    });
    let mut total = Tally::default();
    for result in results {
        total.merge(result?);
    }
    Ok(total)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(err) => {
            eprintln!("fuzz_campaign: {err}\nusage: fuzz_campaign --inputs N --seed S [--jobs J]");
            return ExitCode::from(2);
        }
    };
    panic::set_hook(Box::new(|info| {
        let report = (info.to_string(), Backtrace::force_capture());
        LAST_PANIC.with(|last| *last.borrow_mut() = Some(report));
    }));
    let started = Instant::now();
    let tally = match Fixture::new().and_then(|fixture| campaign(&fixture, &args)) {
        Ok(tally) => tally,
        Err(err) => {
            eprintln!("fuzz_campaign: {err}");
            return ExitCode::FAILURE;
        }
    };
    let seconds = started.elapsed().as_secs_f64();
    let report = Report {
        fuzz_inputs: tally.inputs,
        fuzz_panics: tally.panics,
        largest_allocation_bytes: tally.largest,
        allocation_bound_bytes: ALLOCATION_BOUND,
        seconds: (seconds * 100.0).round() / 100.0,
    };
    match serde_json::to_string(&report) {
        Ok(line) => println!("{line}"),
        Err(err) => eprintln!("fuzz_campaign: {err}"),
    }
    describe(&args, &tally, seconds);
    let failed = tally.panics > 0 || tally.over_bound > 0 || tally.violations > 0;
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn describe(args: &Args, tally: &Tally, seconds: f64) {
    let rate = tally.inputs as f64 / seconds.max(1e-9);
    eprintln!(
        "fuzz_campaign: seed {}, {} jobs, {} inputs in {seconds:.1} s ({rate:.0}/s)",
        args.seed, args.jobs, tally.inputs
    );
    let paths: Vec<String> = tally
        .paths
        .iter()
        .map(|(path, count)| format!("{path} {count}"))
        .collect();
    eprintln!("  by path: {}", paths.join(", "));
    eprintln!(
        "  panics {}, broken properties {}, allocations over {} bytes: {} (largest {} bytes)",
        tally.panics, tally.violations, ALLOCATION_BOUND, tally.over_bound, tally.largest
    );
    for failure in &tally.failures {
        eprintln!("--- failure\n{failure}");
    }
}
