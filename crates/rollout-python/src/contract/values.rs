//! Field types of the contract classes that need more than PyO3's own conversions: NumPy
//! arrays, JSON values, tuples and fields Rust deliberately does not read.

use numpy::{Element, PyArray1, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

/// A `D`-dimensional NumPy array, row-major. Into Python, the data moves into NumPy without a
/// copy; out of Python, any array of the element type is copied (strided ones too).
#[derive(Debug, Clone, PartialEq)]
pub struct Array<T, const D: usize> {
    pub data: Vec<T>,
    pub shape: [usize; D],
}

impl<T> Array<T, 1> {
    pub fn vector(data: Vec<T>) -> Self {
        let shape = [data.len()];
        Array { data, shape }
    }
}

impl<T> Array<T, 2> {
    /// `data` holds `rows * width` elements, row-major.
    pub fn matrix(data: Vec<T>, rows: usize, width: usize) -> Self {
        Array {
            data,
            shape: [rows, width],
        }
    }
}

impl<'py, T: Element, const D: usize> IntoPyObject<'py> for Array<T, D> {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
        let flat = PyArray1::from_vec(py, self.data);
        if D == 1 {
            return Ok(flat.into_any());
        }
        Ok(flat.reshape(self.shape.to_vec())?.into_any())
    }
}

impl<'py, T: Element + Copy, const D: usize> FromPyObject<'_, 'py> for Array<T, D> {
    type Error = PyErr;

    fn extract(object: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        let array = object
            .extract::<PyReadonlyArrayDyn<'py, T>>()
            .map_err(|_| {
                let dtype = T::get_dtype(object.py());
                PyTypeError::new_err(format!("expected a {D}-D {dtype} array"))
            })?;
        let shape: [usize; D] = array.shape().try_into().map_err(|_| {
            PyTypeError::new_err(format!("expected a {D}-D array, got {}-D", array.ndim()))
        })?;
        Ok(Array {
            data: array.as_array().iter().copied().collect(),
            shape,
        })
    }
}

/// A Python `tuple`.
#[derive(Debug, Clone, PartialEq)]
pub struct Tuple<T>(pub Vec<T>);

impl<'py, T: IntoPyObject<'py>> IntoPyObject<'py> for Tuple<T> {
    type Target = PyTuple;
    type Output = Bound<'py, PyTuple>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
        PyTuple::new(py, self.0)
    }
}

/// A JSON value as the plain Python value `json.loads` would give.
#[derive(Debug, Clone, PartialEq)]
pub struct Json(pub serde_json::Value);

impl<'py> IntoPyObject<'py> for Json {
    type Target = PyAny;
    type Output = Bound<'py, PyAny>;
    type Error = PyErr;

    fn into_pyobject(self, py: Python<'py>) -> PyResult<Self::Output> {
        json_to_py(py, &self.0)
    }
}

/// A JSON value as a Python object: objects become dicts, arrays lists.
pub fn json_to_py<'py>(py: Python<'py>, value: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use serde_json::Value;
    Ok(match value {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => b.into_pyobject(py)?.to_owned().into_any(),
        Value::Number(number) => match (number.as_u64(), number.as_i64()) {
            (Some(unsigned), _) => unsigned.into_pyobject(py)?.into_any(),
            (None, Some(signed)) => signed.into_pyobject(py)?.into_any(),
            (None, None) => number
                .as_f64()
                .unwrap_or(f64::NAN)
                .into_pyobject(py)?
                .into_any(),
        },
        Value::String(text) => text.into_pyobject(py)?.into_any(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(json_to_py(py, item)?)?;
            }
            list.into_any()
        }
        Value::Object(fields) => {
            let dict = PyDict::new(py);
            for (key, item) in fields {
                dict.set_item(key, json_to_py(py, item)?)?;
            }
            dict.into_any()
        }
    })
}

/// A field the SDK defines for plugins' own use (e.g. `StepResult.info`) that Rust does not
/// read. Declaring it keeps the contract exact: the field exists on both sides.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unused;

impl FromPyObject<'_, '_> for Unused {
    type Error = PyErr;

    fn extract(_: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        Ok(Unused)
    }
}

impl FromPyObject<'_, '_> for super::Buffer {
    type Error = PyErr;

    fn extract(object: Borrowed<'_, '_, PyAny>) -> PyResult<Self> {
        let object = object.to_owned();
        let buffer = pyo3::buffer::PyBuffer::<u8>::get(&object)?;
        Ok(super::Buffer(buffer.to_vec(object.py())?))
    }
}

impl<'py, V> FromPyObject<'_, 'py> for super::Mapping<V>
where
    V: for<'a> FromPyObject<'a, 'py>,
{
    type Error = PyErr;

    fn extract(object: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        let object = object.to_owned();
        let mapping = object.cast::<pyo3::types::PyMapping>()?;
        let mut items = Vec::new();
        for item in mapping.items()?.iter() {
            let (key, value): (String, Bound<'py, PyAny>) = item.extract()?;
            let value = value.extract::<V>().map_err(|err| {
                let err: PyErr = err.into();
                PyTypeError::new_err(format!("`{key}`: {err}"))
            })?;
            items.push((key, value));
        }
        Ok(super::Mapping(items))
    }
}

/// A TOML value as the plain Python value `tomllib` would give (datetimes as strings).
pub fn toml_to_py<'py>(py: Python<'py>, value: &toml::Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        toml::Value::String(s) => s.into_pyobject(py)?.into_any(),
        toml::Value::Integer(i) => i.into_pyobject(py)?.into_any(),
        toml::Value::Float(f) => f.into_pyobject(py)?.into_any(),
        toml::Value::Boolean(b) => b.into_pyobject(py)?.to_owned().into_any(),
        toml::Value::Datetime(d) => d.to_string().into_pyobject(py)?.into_any(),
        toml::Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(toml_to_py(py, item)?)?;
            }
            list.into_any()
        }
        toml::Value::Table(table) => table_to_py(py, table)?.into_any(),
    })
}

pub fn table_to_py<'py>(py: Python<'py>, table: &toml::Table) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    for (key, value) in table {
        dict.set_item(key, toml_to_py(py, value)?)?;
    }
    Ok(dict)
}

/// A Python object as JSON, through the `json` module (so only JSON-compatible values pass).
pub fn py_to_json(py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<serde_json::Value> {
    let text: String = py
        .import("json")?
        .call_method1("dumps", (value,))?
        .extract()?;
    serde_json::from_str(&text)
        .map_err(|err| pyo3::exceptions::PyValueError::new_err(format!("invalid JSON: {err}")))
}
