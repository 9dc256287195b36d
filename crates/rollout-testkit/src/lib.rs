//! Test tools for Rollout's distributed mode.
//!
//! [`schedule`] decides, without any I/O, which faults a proxied connection suffers and
//! where in its byte stream they happen; [`proxy`] is the TCP proxy (the `fault-proxy`
//! binary) that applies them to real connections.

pub mod proxy;
pub mod schedule;
