//! Rollout's core: everything that decides what happens in a run, without Python.
//!
//! The training controller ([`train`]) drives roles through the traits of [`roles`]; the
//! embedded interpreter (crate `rollout-python`) and remote processes ([`cluster`]) implement
//! them. This crate links no Python: the compiler holds that rule.

pub mod cluster;
pub mod config;
pub mod metrics;
pub mod mismatch;
pub mod plan;
pub mod roles;
pub mod sandbox;
pub mod scheduler;
pub mod seeds;
pub mod telemetry;
pub mod threads;
pub mod train;
