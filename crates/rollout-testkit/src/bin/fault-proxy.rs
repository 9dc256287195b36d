//! `fault-proxy`: a TCP proxy that injects network faults, for testing Rollout's
//! distributed mode. Every accepted connection is forwarded to `--upstream`; the flags
//! add latency, limit bandwidth, drop connections, or stall, corrupt or reset a
//! connection once a number of bytes went through it. Logs go to stderr; the process
//! exits by itself after `--max-seconds`.

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use rollout_testkit::proxy::{ProxyConfig, log, serve};
use rollout_testkit::schedule::{ByteFaults, Scope};

#[derive(Debug, Parser)]
#[command(name = "fault-proxy", version, about)]
struct Args {
    /// Where to accept connections (`host:port`; port 0 picks a free one, shown in the log).
    #[arg(long)]
    listen: String,
    /// Where to forward every connection (`host:port`).
    #[arg(long)]
    upstream: String,
    /// Latency added to every chunk, each way.
    #[arg(long, default_value_t = 0, value_name = "MS")]
    delay_ms: u64,
    /// Bandwidth of each direction of each connection.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    bandwidth_bytes_per_sec: Option<u64>,
    /// Reset (RST) both sides of a connection once N bytes went through it (counted as
    /// `--fault-direction` says).
    #[arg(long, value_name = "N")]
    reset_after_bytes: Option<u64>,
    /// Pause a connection for `--stall-ms` once N bytes went through it.
    #[arg(long, value_name = "N", requires = "stall_ms")]
    stall_after_bytes: Option<u64>,
    /// How long `--stall-after-bytes` pauses.
    #[arg(long, value_name = "MS", requires = "stall_after_bytes")]
    stall_ms: Option<u64>,
    /// Flip the bits of the byte after the first N bytes of a connection.
    #[arg(long, value_name = "N")]
    corrupt_after_bytes: Option<u64>,
    /// Which bytes the reset, stall and corrupt thresholds count.
    #[arg(long, value_enum, default_value_t = Scope::Both)]
    fault_direction: Scope,
    /// Reset the first K accepted connections at once, forwarding nothing.
    #[arg(long, default_value_t = 0, value_name = "K")]
    drop_first_connections: u64,
    /// Only the first N forwarded connections suffer the byte-count faults (all when unset).
    #[arg(long, value_name = "N")]
    faulty_connections: Option<u64>,
    /// Exit after this many seconds, whatever is still connected.
    #[arg(long, default_value_t = 600, value_name = "SECONDS")]
    max_seconds: u64,
}

impl Args {
    fn config(&self) -> ProxyConfig {
        ProxyConfig {
            upstream: self.upstream.clone(),
            delay: Duration::from_millis(self.delay_ms),
            bytes_per_sec: self.bandwidth_bytes_per_sec,
            faults: ByteFaults {
                reset_after: self.reset_after_bytes,
                stall_after: self.stall_after_bytes,
                stall: Duration::from_millis(self.stall_ms.unwrap_or(0)),
                corrupt_after: self.corrupt_after_bytes,
                scope: self.fault_direction,
            },
            drop_first: self.drop_first_connections,
            faulty_connections: self.faulty_connections,
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = args.config();
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let address = listener
        .local_addr()
        .context("the listener has no address")?;
    log(format_args!(
        "listening on {address}, forwarding to {} ({config:?}); exiting after {} s",
        args.upstream, args.max_seconds
    ));
    tokio::select! {
        served = serve(listener, config) => served.context("the proxy stopped")?,
        () = tokio::time::sleep(Duration::from_secs(args.max_seconds)) => {
            log(format_args!("--max-seconds {} reached; exiting", args.max_seconds));
        }
        signal = tokio::signal::ctrl_c() => {
            signal.context("cannot wait for Ctrl-C")?;
            log("interrupted; exiting");
        }
    }
    Ok(())
}
