//! Weights received by a generation worker, handed to the policy: its `import_weights` gets a
//! `rollout_sdk.weights.StreamedWeights` mapping that yields each tensor as a read-only NumPy
//! view of the received bytes (no copy, and no dict of the whole version built first).

use bytes::Bytes;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rollout_net::{Dtype, TensorBytes};

use super::PluginError;
use super::policy::PolicyPlugin;

impl PolicyPlugin {
    /// Replaces the weights with a received version's `tensors` through one call of
    /// `import_weights`.
    pub fn import_received(
        &self,
        py: Python<'_>,
        tensors: Vec<TensorBytes>,
    ) -> Result<(), PluginError> {
        let hook = "import_weights";
        let weights =
            streamed_weights(py, tensors).map_err(|err| self.plugin.raised(py, hook, &err))?;
        self.plugin.call(py, hook, (weights,)).map(drop)
    }
}

/// A `rollout_sdk.weights.StreamedWeights` of a received version's `tensors`.
pub(super) fn streamed_weights(
    py: Python<'_>,
    tensors: Vec<TensorBytes>,
) -> PyResult<Bound<'_, PyAny>> {
    let tensors = Bound::new(py, ReceivedTensors(tensors.into_iter()))?;
    py.import("rollout_sdk.weights")?
        .call_method1("StreamedWeights", (tensors,))
}

/// A received version's tensors: an iterator of `(name, array)` pairs, each array made only
/// when it is reached.
#[pyclass]
struct ReceivedTensors(std::vec::IntoIter<TensorBytes>);

#[pymethods]
impl ReceivedTensors {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&mut self, py: Python<'py>) -> PyResult<Option<(String, Bound<'py, PyAny>)>> {
        let Some(tensor) = self.0.next() else {
            return Ok(None);
        };
        let array = numpy_view(py, &tensor)?;
        Ok(Some((tensor.name, array)))
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
