//! Rollout's Python host: the only crate that links the interpreter.
//!
//! [`interpreter`] starts CPython and runs jobs on its thread; [`plugins`] loads the
//! configured plugins and calls their hooks; [`contract`] converts the values that cross into
//! Python, each defined once here and once in `rollout_sdk`; [`hosts`] serves the roles of
//! `rollout_core::roles` from plugins (a policy's generation, training and tokenizer; the
//! run's rewards, environments, data and callbacks).

pub mod contract;
mod error;
pub mod export;
pub mod hosts;
pub mod interpreter;
mod paged_generator;
pub mod plugins;
pub mod quickstart;

pub use error::HostError;
