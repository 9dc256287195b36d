//! The TOML run configuration.

mod agents;
mod algorithm;
mod cluster;
mod devices;
mod engine;
mod load;
mod loaded;
mod location;
mod schema;
mod train;
mod validate;

pub use agents::{AgentConfig, AgentSpec};
pub use algorithm::{AdvantageEstimator, Algorithm, AlgorithmConfig};
pub use cluster::{ClusterConfig, DroppedGroups, GradientCompression};
pub use devices::{
    DeviceAssignment, DeviceEntry, DeviceSpec, DevicesConfig, Misplaced, ProcessDevices,
    VisibleDevices, assign, assign_devices,
};
pub use load::{load, load_text, parse_override_value, suggest, with_suggestion};
pub use loaded::{ConfigError, LoadedConfig};
pub use location::{KeyPath, Location, Segment};
pub use schema::*;
pub use train::{FloatDtype, FsdpConfig, Sharding, TrainConfig};

/// The metric name of a reward: its `name`, else its class name in snake case.
pub fn reward_name(reward: &RewardConfig) -> String {
    if let Some(name) = &reward.name {
        return name.clone();
    }
    let class = reward
        .plugin
        .rsplit([':', '.'])
        .next()
        .unwrap_or(&reward.plugin);
    let mut name = String::with_capacity(class.len() + 4);
    for (i, ch) in class.chars().enumerate() {
        if ch.is_uppercase() && i > 0 {
            name.push('_');
        }
        name.extend(ch.to_lowercase());
    }
    name
}
