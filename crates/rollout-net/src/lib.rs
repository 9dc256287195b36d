//! Rollout's transport layer: the messages roles exchange and the framing that carries them
//! between processes and machines.

pub mod messages;
