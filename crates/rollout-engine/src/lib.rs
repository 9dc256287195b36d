//! The `rollout` engine: configuration, the embedded Python plugin host, the roles and the
//! training loop that drives them.

pub mod cluster;
pub mod config;
pub mod engine;
pub mod environments;
pub mod generation;
pub mod live_episodes;
pub mod local;
pub mod plan;
pub mod plugins;
pub mod python;
pub mod report;
pub mod roles;
pub mod sandbox;
pub mod scoring;
pub mod session;
pub mod sweep;
pub mod team_session;
pub mod telemetry;
pub mod trace;
pub mod train;
