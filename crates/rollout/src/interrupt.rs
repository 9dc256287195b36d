//! Ctrl-C: the first asks the run to stop after the current step (with a checkpoint), the
//! second exits at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// The exit status of an interrupted run.
pub const EXIT_CODE: u8 = 130;

/// The first Ctrl-C asks the run to stop after the current step (and checkpoint); the second
/// exits at once, which is safe because checkpoints are only ever replaced atomically.
pub fn watch_ctrl_c() -> Arc<AtomicBool> {
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            flag.store(true, Ordering::SeqCst);
            eprintln!(
                "\nstopping after the current step and writing a checkpoint (Ctrl-C again to stop now)"
            );
            if tokio::signal::ctrl_c().await.is_ok() {
                crate::trace::finish_and_log();
                std::process::exit(i32::from(EXIT_CODE));
            }
        }
    });
    interrupted
}
