//! End-to-end tests of the scheduler against a fake model (see [`fake`]).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod fake;
mod invariants;
mod properties;
mod scenarios;
