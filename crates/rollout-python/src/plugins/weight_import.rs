//! Weights received by a generation worker, handed to the policy bucket by bucket: its
//! `import_weights` gets a `rollout_sdk.weights.StreamedWeights` mapping that yields each
//! tensor once its bucket is in, as a read-only NumPy view of the received bytes (no dict of
//! the whole version is built first).

use std::collections::VecDeque;

use bytes::Bytes;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rollout_core::cluster::weights::{Bucket, TensorAssembler};
use rollout_net::{Dtype, TensorBytes};
use tokio::sync::mpsc::UnboundedReceiver;

use super::PluginError;
use super::policy::PolicyPlugin;

impl PolicyPlugin {
    /// Replaces the weights with the version whose buckets come on `arrivals` (verified, in
    /// order) through one call of `import_weights`. Returns once the policy does, which is
    /// after the last bucket if it reads every tensor.
    pub fn import_arriving(
        &self,
        py: Python<'_>,
        arrivals: UnboundedReceiver<Bucket>,
    ) -> Result<(), PluginError> {
        let hook = "import_weights";
        let weights = (|| -> PyResult<Bound<'_, PyAny>> {
            let tensors = Bound::new(py, ArrivingTensors::new(arrivals))?;
            py.import("rollout_sdk.weights")?
                .call_method1("StreamedWeights", (tensors,))
        })()
        .map_err(|err| self.plugin.raised(py, hook, &err))?;
        self.plugin.call(py, hook, (weights,)).map(drop)
    }
}

/// The tensors of a version's buckets as they arrive: an iterator of `(name, array)` pairs
/// that waits for the next bucket without holding the GIL. It raises if the buckets stop
/// before the version's last one (the pull failed).
#[pyclass]
struct ArrivingTensors {
    arrivals: UnboundedReceiver<Bucket>,
    assembler: Option<TensorAssembler>,
    ready: VecDeque<TensorBytes>,
    /// The index and count of the last bucket in.
    last: Option<(u32, u32)>,
}

impl ArrivingTensors {
    fn new(arrivals: UnboundedReceiver<Bucket>) -> Self {
        Self {
            arrivals,
            assembler: Some(TensorAssembler::default()),
            ready: VecDeque::new(),
            last: None,
        }
    }
}

#[pymethods]
impl ArrivingTensors {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&mut self, py: Python<'py>) -> PyResult<Option<(String, Bound<'py, PyAny>)>> {
        loop {
            if let Some(tensor) = self.ready.pop_front() {
                let array = numpy_view(py, &tensor)?;
                return Ok(Some((tensor.name, array)));
            }
            let Some(assembler) = self.assembler.as_mut() else {
                return Ok(None);
            };
            let arrivals = &mut self.arrivals;
            match py.detach(|| arrivals.blocking_recv()) {
                Some(bucket) => {
                    self.last = Some((bucket.header.index, bucket.header.count));
                    let tensors = assembler
                        .add(&bucket)
                        .map_err(|err| PyRuntimeError::new_err(err.to_string()))?;
                    self.ready.extend(tensors);
                }
                None => {
                    let complete = self.last.is_some_and(|(index, count)| index + 1 == count);
                    if let Some(assembler) = self.assembler.take() {
                        assembler
                            .finish()
                            .map_err(|err| PyRuntimeError::new_err(err.to_string()))?;
                    }
                    if !complete {
                        let (index, count) = self.last.map_or((0, 0), |(i, c)| (i + 1, c));
                        return Err(PyRuntimeError::new_err(format!(
                            "the weight version stopped arriving after {index} of {count} \
                             buckets (its pull failed)"
                        )));
                    }
                    return Ok(None);
                }
            }
        }
    }
}

/// A read-only NumPy view of `tensor`'s received bytes, in its shape.
fn numpy_view<'py>(py: Python<'py>, tensor: &TensorBytes) -> PyResult<Bound<'py, PyAny>> {
    let bytes = Bound::new(py, ReceivedBytes(tensor.data.clone()))?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("dtype", numpy_code(tensor.dtype))?;
    py.import("numpy")?
        .call_method("frombuffer", (bytes,), Some(&kwargs))?
        .call_method1("reshape", (tensor.shape.clone(),))
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
