//! The typed contract between Rollout and `rollout_sdk`: every value that crosses into or out
//! of Python as an SDK dataclass is defined once here (Rust) and once in the SDK (Python).
//!
//! [`classes`] holds the definitions, each a plain struct whose conversion is derived
//! (`IntoPyObject` builds the dataclass's keyword arguments, `FromPyObject` reads its
//! attributes), so no plugin wrapper spells a field name. [`convert`] builds them from the
//! core's types and back. The test `tests/contract.rs` checks every class against the SDK:
//! the same field names, in the same order, with the same optionality. A field added on one
//! side only fails CI instead of silently falling back to a default.

mod classes;
mod convert;
mod values;

use pyo3::exceptions::{PyAttributeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyModule};

pub use classes::*;
pub use values::{Array, Json, Tuple, Unused, json_to_py, py_to_json, table_to_py};

/// A struct that is an SDK dataclass of the same name.
pub trait SdkClass {
    /// The class's name in `rollout_sdk`.
    const CLASS: &'static str;
}

/// One field of a contract class, as Rust declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldSpec {
    pub name: &'static str,
    /// Whether the field may be absent (`None` in Python, `Option` in Rust).
    pub optional: bool,
}

/// A contract class and its fields, in declaration order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassSpec {
    pub class: &'static str,
    pub fields: Vec<FieldSpec>,
}

/// How a field type treats absence: only an `Option` is optional (`None` in Python). Reading
/// a plugin's object, a missing attribute is `None` for an `Option`, ignored for an [`Unused`]
/// field and an error otherwise.
pub trait FieldKind: Sized {
    const OPTIONAL: bool = false;

    fn missing(class: &str, field: &str) -> PyResult<Self> {
        Err(PyAttributeError::new_err(format!(
            "{class} has no attribute `{field}`"
        )))
    }
}

impl<T> FieldKind for Option<T> {
    const OPTIONAL: bool = true;

    fn missing(_: &str, _: &str) -> PyResult<Self> {
        Ok(None)
    }
}

macro_rules! required_fields {
    ($($ty:ty),* $(,)?) => { $(impl FieldKind for $ty {})* };
}

required_fields!(bool, u32, u64, f32, f64, String, Json);

impl FieldKind for Unused {
    fn missing(_: &str, _: &str) -> PyResult<Self> {
        Ok(Unused)
    }
}
impl<T, const D: usize> FieldKind for Array<T, D> {}
impl<T> FieldKind for Tuple<T> {}
impl<K, V> FieldKind for std::collections::BTreeMap<K, V> {}
impl<V> FieldKind for Vec<V> {}

/// `rollout_sdk`, imported once per process.
fn sdk(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    static SDK: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
    SDK.get_or_try_init(py, || Ok(py.import("rollout_sdk")?.unbind()))
        .map(|module| module.bind(py))
}

/// `value` as an instance of its SDK dataclass.
pub fn to_python<'py, T>(py: Python<'py>, value: T) -> PyResult<Bound<'py, PyAny>>
where
    T: SdkClass + IntoPyObject<'py, Target = PyDict, Output = Bound<'py, PyDict>, Error = PyErr>,
{
    let fields = value.into_pyobject(py)?;
    sdk(py)?.getattr(T::CLASS)?.call((), Some(&fields))
}

/// Reads an SDK dataclass (or any object with its attributes) returned by a plugin. The error
/// names the field that did not convert and why.
pub fn from_python<'py, T>(object: &Bound<'py, PyAny>) -> Result<T, String>
where
    T: SdkClass + for<'a> FromPyObject<'a, 'py>,
{
    object.extract::<T>().map_err(|err| {
        let err: PyErr = err.into();
        format!("must return a rollout_sdk.{} ({err})", T::CLASS)
    })
}

/// Field `field` of `object` (an instance of SDK class `class`), its conversion error naming
/// the field.
fn read_field<'py, T>(object: &Borrowed<'_, 'py, PyAny>, class: &str, field: &str) -> PyResult<T>
where
    T: FieldKind + for<'a> FromPyObject<'a, 'py>,
{
    let Some(value) = object.getattr_opt(field)? else {
        return T::missing(class, field);
    };
    value.extract::<T>().map_err(|err| {
        let err: PyErr = err.into();
        PyTypeError::new_err(format!("{class}.{field}: {err}"))
    })
}
