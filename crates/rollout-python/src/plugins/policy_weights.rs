//! The policy plugin's weights as bytes (export for weight sync, import on generation
//! workers) and its data-parallel group (gradients all-reduced across trainer ranks).

use std::collections::BTreeMap;
use std::sync::Arc;

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyIterator, PyModule};
use rollout_core::cluster::buckets::{ExportedVersion, PlannedVersion, Serving, VersionBuilder};
use rollout_core::cluster::in_place::ServedInPlace;
use rollout_core::config::{ClusterConfig, Sharding as ShardingMode, TrainConfig};
use rollout_net::Dtype;

use super::PluginError;
use super::policy::PolicyPlugin;
use super::policy_in_place::{LentTensor, lent_bytes};
use crate::contract::{Sharding, to_python};

/// A policy's weights for export.
enum Weights<'py> {
    /// Every tensor at once (the policy returned a dict).
    Held(Vec<WeightView<'py>>),
    /// `(name, array)` pairs, one at a time.
    Streamed(Bound<'py, PyIterator>),
}

/// One tensor's bytes, read in place from the array the policy returned.
struct WeightView<'py> {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    array: PyReadonlyArray1<'py, u8>,
}

impl WeightView<'_> {
    fn bytes(&self) -> &[u8] {
        // Contiguous: checked when the view was taken (see `PolicyPlugin::weight_view`).
        self.array.as_slice().unwrap_or_default()
    }
}

impl PolicyPlugin {
    /// Joins the trainers' torch.distributed process group (`env://` rendezvous:
    /// `MASTER_ADDR`/`MASTER_PORT`) on `cluster.backend`. Replicated, every update then
    /// all-reduces the gradients, compressed as `cluster` says; sharded (`train.sharding`),
    /// the policy shards itself and its gradients are reduce-scattered in the backward pass.
    pub fn join_data_parallel(
        &self,
        py: Python<'_>,
        rank: u32,
        world_size: u32,
        cluster: &ClusterConfig,
        train: &TrainConfig,
    ) -> Result<(), PluginError> {
        let hook = "trainable_parameters";
        let parameters = self.plugin.call(py, hook, ())?;
        let distributed = py
            .import("rollout_sdk.distributed")
            .and_then(|d| {
                d.call_method1(
                    "init_process_group",
                    (cluster.backend.as_str(), rank, world_size, parameters),
                )?;
                Ok(d)
            })
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        let group = match train.sharding {
            ShardingMode::Replicate => distributed
                .call_method1(
                    "GradientReducer",
                    (
                        cluster.gradient_compression.as_str(),
                        cluster.powersgd_rank,
                        cluster.powersgd_warmup_updates,
                    ),
                )
                .map_err(|err| self.plugin.raised(py, hook, &err))?,
            ShardingMode::Fsdp => self.shard(py, &distributed, train)?,
        };
        let _ = self.data_parallel.set(group.unbind());
        Ok(())
    }

    /// Has the policy shard itself (`Policy.shard`) and wraps what it sharded in the
    /// `FullyShardedGroup` that drives its gradient reduction.
    fn shard<'py>(
        &self,
        py: Python<'py>,
        distributed: &Bound<'py, PyModule>,
        train: &TrainConfig,
    ) -> Result<Bound<'py, PyAny>, PluginError> {
        let hook = "shard";
        let sharding = to_python(py, Sharding::from(train))
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        let roots = match self
            .plugin
            .object
            .bind(py)
            .call_method1(hook, (sharding.clone(),))
        {
            Ok(roots) => roots,
            Err(err) if err.is_instance_of::<pyo3::exceptions::PyNotImplementedError>(py) => {
                return Err(self.plugin.bad_return(
                    hook,
                    "this policy cannot be sharded (its `shard` is not implemented): set \
                     [train] sharding = \"replicate\"",
                ));
            }
            Err(err) => return Err(self.plugin.raised(py, hook, &err)),
        };
        distributed
            .call_method1("FullyShardedGroup", (roots, sharding))
            .map_err(|err| self.plugin.raised(py, hook, &err))
    }

    /// Tells the data-parallel group a micro-batch comes next, and whether it is the last of
    /// the update (a sharded group reduces gradients in the last one's backward pass only).
    pub(super) fn before_micro_batch(
        &self,
        py: Python<'_>,
        group: &Py<PyAny>,
        last: bool,
    ) -> Result<(), PluginError> {
        group
            .bind(py)
            .call_method1("before_micro_batch", (last,))
            .map(drop)
            .map_err(|err| self.plugin.raised(py, "train_step", &err))
    }

    /// Leaves the process group once every rank is here, so no collective is cut short.
    pub fn leave_data_parallel(&self, py: Python<'_>) -> Result<(), PluginError> {
        if self.data_parallel.get().is_none() {
            return Ok(());
        }
        py.import("rollout_sdk.distributed")
            .and_then(|d| d.call_method0("leave_process_group"))
            .map_err(|err| self.plugin.raised(py, "leave_process_group", &err))?;
        Ok(())
    }

    pub(super) fn all_reduce_gradients(
        &self,
        py: Python<'_>,
        reducer: &Py<PyAny>,
    ) -> Result<BTreeMap<String, f64>, PluginError> {
        let hook = "trainable_parameters";
        let parameters = self.plugin.call(py, hook, ())?;
        let metrics = reducer
            .bind(py)
            .call_method1("reduce", (parameters,))
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        self.float_metrics(hook, &metrics)
    }

    /// Exports the weights as `version`, in buckets of about `bucket_bytes`, and `report`s
    /// it. Served (`serving` holds an earlier version's bucket allocations), the version is
    /// reported at once, unsealed, with the buffer pullers are served from, which seals once
    /// every bucket is hashed: [`Serving::Copied`], its buckets are then filled into it and
    /// checksummed, bucket by bucket, so pullers start while the rest is copied, and the job
    /// ends once every bucket is in; [`Serving::InPlace`], its buckets view the arrays the
    /// policy lent, each hashed as it is first sent, until the policy settles the version
    /// (copies it) before a hook that may change the weights. Otherwise it is reported with
    /// its checksum.
    ///
    /// A mapping from `weight_views` (or `export_weights`) is read in place: to send, copy
    /// or checksum the buckets. Pairs handed over one at a time (a sharded policy gathers
    /// each as it is asked for) are copied into buckets as they come, and the version is
    /// reported, sealed, once all are in.
    pub fn export_version(
        &self,
        py: Python<'_>,
        version: u64,
        bucket_bytes: u64,
        serving: Option<Serving>,
        report: impl FnOnce(Result<ExportedVersion, PluginError>),
    ) {
        let (hook, weights) = match self.weights(py) {
            Ok(weights) => weights,
            Err(err) => return report(Err(err)),
        };
        let held = match weights {
            Weights::Held(held) => held,
            Weights::Streamed(pairs) => {
                return report(self.build_version(
                    py,
                    hook,
                    pairs,
                    (version, bucket_bytes),
                    serving.map(Serving::into_allocations),
                ));
            }
        };
        let serving = match serving {
            Some(Serving::InPlace(allocations)) => {
                return self.serve_in_place(
                    py,
                    hook,
                    &held,
                    (version, bucket_bytes),
                    allocations,
                    report,
                );
            }
            other => other.map(Serving::into_allocations),
        };
        let tensors = held.iter().map(|view| {
            (
                view.name.as_str(),
                view.dtype,
                view.shape.as_slice(),
                view.bytes(),
            )
        });
        let planned = match PlannedVersion::plan(version, bucket_bytes, tensors) {
            Ok(planned) => planned,
            Err(err) => return report(Err(self.plugin.bad_return(hook, err.to_string()))),
        };
        let Some(allocations) = serving else {
            return report(Ok(ExportedVersion {
                version,
                checksum: Some(planned.checksum()),
                bytes: planned.bytes(),
                buffer: None,
            }));
        };
        let buffer = Arc::new(planned.buffer());
        report(Ok(ExportedVersion {
            version,
            checksum: None,
            bytes: planned.bytes(),
            buffer: Some(buffer.clone()),
        }));
        tracing::info_span!("weights.fill", version)
            .in_scope(|| planned.fill(&buffer, allocations));
    }

    /// Serves the `held` views in place (see [`PolicyPlugin::export_version`]).
    fn serve_in_place(
        &self,
        py: Python<'_>,
        hook: &'static str,
        held: &[WeightView<'_>],
        (version, bucket_bytes): (u64, u64),
        allocations: Vec<Vec<u8>>,
        report: impl FnOnce(Result<ExportedVersion, PluginError>),
    ) {
        let lent = held.iter().map(|view| -> LentTensor {
            let bytes = lent_bytes(view.array.as_any(), view.bytes());
            (view.name.clone(), view.dtype, view.shape.clone(), bytes)
        });
        let served = match ServedInPlace::plan(version, bucket_bytes, lent, allocations) {
            Ok(served) => served,
            Err(err) => return report(Err(self.plugin.bad_return(hook, err.to_string()))),
        };
        report(Ok(ExportedVersion {
            version,
            checksum: None,
            bytes: served.bytes(),
            buffer: Some(served.buffer().clone()),
        }));
        self.keep_served_in_place(py, served);
    }

    /// Copies tensors into buckets as `pairs` hands them over.
    fn build_version(
        &self,
        py: Python<'_>,
        hook: &'static str,
        pairs: Bound<'_, PyIterator>,
        (version, bucket_bytes): (u64, u64),
        serving: Option<Vec<Vec<u8>>>,
    ) -> Result<ExportedVersion, PluginError> {
        let serves = serving.is_some();
        let mut builder = VersionBuilder::new(version, bucket_bytes, serving.unwrap_or_default());
        let numpy = py
            .import("numpy")
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        for pair in pairs {
            let view = self.weight_view(py, hook, &numpy, pair)?;
            builder
                .push(&view.name, view.dtype, &view.shape, view.bytes())
                .map_err(|err| self.plugin.bad_return(hook, err.to_string()))?;
        }
        let buffer = builder.finish();
        Ok(ExportedVersion {
            version,
            checksum: Some(buffer.checksum()),
            bytes: buffer.bytes(),
            buffer: serves.then(|| Arc::new(buffer)),
        })
    }

    /// What `weight_views` returns (the SDK's default is `export_weights`: views may be
    /// lent, not copies), and the hook that returned it.
    pub(super) fn weight_views<'py>(
        &self,
        py: Python<'py>,
    ) -> Result<(&'static str, Bound<'py, PyAny>), PluginError> {
        let lends_views = self
            .plugin
            .object
            .bind(py)
            .hasattr("weight_views")
            .unwrap_or(false);
        let hook = if lends_views {
            "weight_views"
        } else {
            "export_weights"
        };
        Ok((hook, self.plugin.call(py, hook, ())?))
    }

    /// [`PolicyPlugin::weight_views`]: every tensor at once from a dict, else an iterator of
    /// pairs.
    fn weights<'py>(&self, py: Python<'py>) -> Result<(&'static str, Weights<'py>), PluginError> {
        let (hook, weights) = self.weight_views(py)?;
        let pairs = match weights.cast::<PyDict>() {
            Ok(dict) => dict.items().into_any(),
            Err(_) => weights.clone(),
        };
        let pairs = pairs.try_iter().map_err(|_| {
            self.plugin.bad_return(
                hook,
                "must return a dict of numpy arrays or an iterable of (name, array) pairs",
            )
        })?;
        if !weights.is_instance_of::<PyDict>() {
            return Ok((hook, Weights::Streamed(pairs)));
        }
        let numpy = py
            .import("numpy")
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        let held = pairs
            .map(|pair| self.weight_view(py, hook, &numpy, pair))
            .collect::<Result<_, _>>()?;
        Ok((hook, Weights::Held(held)))
    }

    fn weight_view<'py>(
        &self,
        py: Python<'py>,
        hook: &'static str,
        numpy: &Bound<'py, PyModule>,
        pair: PyResult<Bound<'py, PyAny>>,
    ) -> Result<WeightView<'py>, PluginError> {
        let pair = pair.map_err(|err| self.plugin.raised(py, hook, &err))?;
        let (name, array): (String, Bound<'_, PyAny>) = pair.extract().map_err(|_| {
            self.plugin
                .bad_return(hook, "names must be str, each with one array")
        })?;
        let (dtype, shape, array) =
            raw_bytes(numpy, &array).map_err(|err| self.plugin.raised(py, hook, &err))?;
        let dtype = dtype.ok_or_else(|| {
            self.plugin.bad_return(
                hook,
                format!("`{name}` has a dtype that cannot be sent (use float32, float16, integer or bool)"),
            )
        })?;
        if let Err(err) = array.as_slice() {
            return Err(self.plugin.bad_return(hook, format!("`{name}`: {err}")));
        }
        Ok(WeightView {
            name,
            dtype,
            shape,
            array,
        })
    }
}

/// An array's wire dtype (`None` if it has none), shape and bytes: a flat `uint8` view of
/// the array itself when it is C-contiguous (a copy only when it is not).
fn raw_bytes<'py>(
    numpy: &Bound<'py, PyModule>,
    array: &Bound<'py, PyAny>,
) -> PyResult<(Option<Dtype>, Vec<u64>, PyReadonlyArray1<'py, u8>)> {
    let array = numpy.call_method1("ascontiguousarray", (array,))?;
    let code: String = array.getattr("dtype")?.getattr("str")?.extract()?;
    let shape: Vec<u64> = array.getattr("shape")?.extract()?;
    let flat = array
        .call_method1("reshape", (-1,))?
        .call_method1("view", (numpy.getattr("uint8")?,))?;
    let bytes = flat.cast_into::<PyArray1<u8>>()?.readonly();
    Ok((dtype_of_numpy(&code), shape, bytes))
}

/// The wire dtype of a numpy dtype string (`dtype.str`), little-endian only.
fn dtype_of_numpy(code: &str) -> Option<Dtype> {
    Some(match code {
        "<f4" => Dtype::F32,
        "<f2" => Dtype::F16,
        "<f8" => Dtype::F64,
        "<i8" => Dtype::I64,
        "<i4" => Dtype::I32,
        "<i2" => Dtype::I16,
        "|i1" => Dtype::I8,
        "<u8" => Dtype::U64,
        "<u4" => Dtype::U32,
        "<u2" => Dtype::U16,
        "|u1" => Dtype::U8,
        "|b1" => Dtype::Bool,
        _ => return None,
    })
}
