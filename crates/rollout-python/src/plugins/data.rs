//! The data source and its transforms.

use pyo3::prelude::*;
use rollout_core::config::{KeyPath, LoadedConfig};
use rollout_core::roles::Record;

use super::{PluginError, PluginLoadError, PluginRef};
use crate::contract::py_to_json;

pub struct DataPlugins {
    source: PluginRef,
    transforms: Vec<PluginRef>,
}

impl DataPlugins {
    pub fn load(py: Python<'_>, loaded: &LoadedConfig) -> Result<Self, PluginLoadError> {
        let data = &loaded.config.data;
        let key = KeyPath::default().key("data");
        let source = PluginRef::load(py, loaded, &key, &data.plugin, &data.options, "DataSource")?;
        let transforms = data
            .transforms
            .iter()
            .enumerate()
            .map(|(index, transform)| {
                let key = key.clone().key("transforms").index(index);
                PluginRef::load(
                    py,
                    loaded,
                    &key,
                    &transform.plugin,
                    &transform.options,
                    "Transform",
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DataPlugins { source, transforms })
    }

    /// Every record of the source, through the transforms in order (a `None` drops it).
    pub fn records(&self, py: Python<'_>) -> Result<Vec<Record>, PluginError> {
        let hook = "records";
        let iterator = self
            .source
            .call(py, hook, ())?
            .try_iter()
            .map_err(|err| self.source.raised(py, hook, &err))?;
        let mut records = Vec::new();
        'records: for (index, item) in iterator.enumerate() {
            let mut record = item.map_err(|err| self.source.raised(py, hook, &err))?;
            for transform in &self.transforms {
                record = transform
                    .object
                    .bind(py)
                    .call1((record,))
                    .map_err(|err| transform.raised(py, "__call__", &err))?;
                if record.is_none() {
                    continue 'records;
                }
            }
            let fields = py_to_json(py, &record).map_err(|err| {
                self.source.bad_return(
                    hook,
                    format!("record {index} is not JSON-compatible: {err}"),
                )
            })?;
            let Some(prompt) = fields.get("prompt").and_then(|p| p.as_str()) else {
                return Err(self.source.bad_return(
                    hook,
                    format!("record {index} has no string `prompt` after the transforms"),
                ));
            };
            records.push(Record {
                prompt: prompt.to_owned(),
                fields,
            });
        }
        if records.is_empty() {
            return Err(self
                .source
                .bad_return(hook, "no records left after the transforms"));
        }
        Ok(records)
    }
}
