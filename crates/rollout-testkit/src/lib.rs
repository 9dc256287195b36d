//! Test tools for Rollout.
//!
//! [`fakes`] implements every role of `rollout_core::roles` without Python or a model
//! (generation, rewards, training, environments, observers) and a generation worker that
//! answers over a real authenticated link, for the controller's, the cluster's and the
//! benchmarks' tests. [`schedule`] decides, without any I/O, which faults a proxied
//! connection suffers and where in its byte stream they happen; [`proxy`] is the TCP proxy
//! (the `fault-proxy` binary) that applies them to real connections.

pub mod fakes;
pub mod proxy;
pub mod schedule;
