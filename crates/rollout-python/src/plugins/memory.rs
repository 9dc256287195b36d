//! A colocated generation worker's device memory: released while the trainers step on the
//! same devices, restored before it generates again (`Policy.release_memory` and
//! `Policy.restore_memory`; a policy without them keeps its memory).

use pyo3::prelude::*;

use super::PluginError;
use super::policy::PolicyPlugin;

impl PolicyPlugin {
    /// Frees what generation holds on the device (the HF policy: its KV cache, and its
    /// weights moved to the host).
    pub fn release_memory(&self, py: Python<'_>) -> Result<(), PluginError> {
        self.settle_served_version(py);
        self.call_if_defined(py, "release_memory")
    }

    /// Takes back what [`PolicyPlugin::release_memory`] freed.
    pub fn restore_memory(&self, py: Python<'_>) -> Result<(), PluginError> {
        self.call_if_defined(py, "restore_memory")
    }

    fn call_if_defined(&self, py: Python<'_>, hook: &'static str) -> Result<(), PluginError> {
        let defined = self
            .plugin
            .object
            .bind(py)
            .hasattr(hook)
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        if defined {
            self.plugin.call(py, hook, ())?;
        }
        Ok(())
    }
}
