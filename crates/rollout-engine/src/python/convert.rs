//! Conversions between Rust values and Python objects.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

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

/// A JSON value as a Python object, through the `json` module.
pub fn json_to_py<'py>(py: Python<'py>, value: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    let text = value.to_string();
    py.import("json")?.call_method1("loads", (text,))
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
