//! The policy plugin's weights as bytes (export for weight sync, import on generation
//! workers) and its data-parallel group (gradients all-reduced across trainer ranks).

use std::collections::BTreeMap;

use bytes::Bytes;
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyModule};
use rollout_core::config::{ClusterConfig, Sharding as ShardingMode, TrainConfig};
use rollout_net::{Dtype, TensorBytes};

use super::PluginError;
use super::policy::PolicyPlugin;
use crate::contract::{Sharding, to_python};

/// Takes one exported tensor: its name, dtype, shape and bytes.
pub type TensorSink<'a, E> = dyn FnMut(&str, Dtype, &[u64], &[u8]) -> Result<(), E> + 'a;

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

    /// Hands each tensor `weight_views` (or `export_weights`) lists, in order, to `sink` as
    /// raw little-endian bytes read in place from the array the policy returned (nothing is
    /// copied on the way; a sharded policy gathers each tensor as it is asked for).
    pub fn export_weights<E: std::fmt::Display>(
        &self,
        py: Python<'_>,
        sink: &mut TensorSink<'_, E>,
    ) -> Result<(), PluginError> {
        // `weight_views` (the SDK's default is `export_weights`) may lend views, not copies.
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
        let weights = self.plugin.call(py, hook, ())?;
        let pairs = match weights.cast::<PyDict>() {
            Ok(dict) => dict.items().into_any(),
            Err(_) => weights,
        };
        let pairs = pairs.try_iter().map_err(|_| {
            self.plugin.bad_return(
                hook,
                "must return a dict of numpy arrays or an iterable of (name, array) pairs",
            )
        })?;
        let numpy = py
            .import("numpy")
            .map_err(|err| self.plugin.raised(py, hook, &err))?;
        for pair in pairs {
            let pair = pair.map_err(|err| self.plugin.raised(py, hook, &err))?;
            let (name, array): (String, Bound<'_, PyAny>) = pair.extract().map_err(|_| {
                self.plugin
                    .bad_return(hook, "names must be str, each with one array")
            })?;
            let (dtype, shape, bytes) =
                raw_bytes(&numpy, &array).map_err(|err| self.plugin.raised(py, hook, &err))?;
            let dtype = dtype.ok_or_else(|| {
                self.plugin.bad_return(
                    hook,
                    format!("`{name}` has a dtype that cannot be sent (use float32, float16, integer or bool)"),
                )
            })?;
            let bytes = bytes
                .as_slice()
                .map_err(|err| self.plugin.bad_return(hook, format!("`{name}`: {err}")))?;
            sink(&name, dtype, &shape, bytes)
                .map_err(|err| self.plugin.bad_return(hook, format!("`{name}`: {err}")))?;
        }
        Ok(())
    }

    /// Replaces the weights with `tensors` (checked against the model by `import_weights`).
    /// Each array handed to the policy is a read-only view of the bytes as they arrived.
    pub fn import_weights(
        &self,
        py: Python<'_>,
        tensors: &[TensorBytes],
    ) -> Result<(), PluginError> {
        let hook = "import_weights";
        let weights = (|| -> PyResult<Bound<'_, PyDict>> {
            let numpy = py.import("numpy")?;
            let weights = PyDict::new(py);
            for tensor in tensors {
                let bytes = Bound::new(py, ReceivedBytes(tensor.data.clone()))?;
                let kwargs = PyDict::new(py);
                kwargs.set_item("dtype", numpy_code(tensor.dtype))?;
                let array = numpy
                    .call_method("frombuffer", (bytes,), Some(&kwargs))?
                    .call_method1("reshape", (tensor.shape.clone(),))?;
                weights.set_item(&tensor.name, array)?;
            }
            Ok(weights)
        })()
        .map_err(|err| self.plugin.raised(py, hook, &err))?;
        self.plugin.call(py, hook, (weights,)).map(drop)
    }
}

/// Bytes received for a tensor, lent to Python as a read-only buffer (what
/// `numpy.frombuffer` views without copying); the bytes live as long as any view of them.
#[pyclass(frozen)]
struct ReceivedBytes(Bytes);

// The buffer protocol has no safe binding: this one method is the crate's only unsafe code.
#[allow(unsafe_code)]
#[pymethods]
impl ReceivedBytes {
    /// # Safety
    /// Called by CPython with a valid `view` to fill, as the buffer protocol requires.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let bytes = &slf.get().0;
        let len = isize::try_from(bytes.len())
            .map_err(|_| pyo3::exceptions::PyBufferError::new_err("too large for a buffer"))?;
        // SAFETY: `view` comes from CPython; the buffer lies in `Bytes` that this object owns
        // and never changes, and `PyBuffer_FillInfo` takes a reference to the object, so the
        // bytes outlive every view. Read-only: a request to write fails with BufferError.
        let filled = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                bytes.as_ptr().cast_mut().cast(),
                len,
                1,
                flags,
            )
        };
        if filled == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
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

/// The numpy dtype string of a wire dtype (bfloat16 travels as raw 16-bit words).
fn numpy_code(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::F32 => "<f4",
        Dtype::F16 => "<f2",
        Dtype::F64 => "<f8",
        Dtype::I64 => "<i8",
        Dtype::I32 => "<i4",
        Dtype::I16 => "<i2",
        Dtype::I8 => "|i1",
        Dtype::U64 => "<u8",
        Dtype::U32 => "<u4",
        Dtype::U16 | Dtype::BF16 => "<u2",
        Dtype::U8 | Dtype::F8E4M3 | Dtype::F8E5M2 => "|u1",
        Dtype::Bool => "|b1",
    }
}
