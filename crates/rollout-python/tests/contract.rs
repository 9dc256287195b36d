//! The contract holds the languages together: every class Rust converts to or from Python has
//! exactly the fields of its `rollout_sdk` dataclass (names, order and optionality), so a
//! field added, renamed or dropped on one side only fails here instead of silently falling
//! back to a default.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;

use pyo3::prelude::*;
use rollout_core::metrics::StepMetrics;
use rollout_net::messages::{FailureReason, FinishReason, ScoreSample};
use rollout_python::contract::{ClassSpec, FieldSpec, classes};
use rollout_python::interpreter::{PythonSetup, PythonWorker};

/// Lists a dataclass's fields as `(name, optional)`: optional where the annotation admits
/// `None`.
const DESCRIBE: &std::ffi::CStr = c"
import dataclasses
import typing

import rollout_sdk


def describe(name):
    cls = getattr(rollout_sdk, name)
    hints = typing.get_type_hints(cls)
    return [
        (field.name, type(None) in typing.get_args(hints[field.name]))
        for field in dataclasses.fields(cls)
    ]
";

fn python() -> PythonWorker {
    let setup = PythonSetup::discover(None, &[]).expect("a Python environment with rollout_sdk");
    PythonWorker::start(setup).expect("the interpreter starts")
}

fn sdk_fields(worker: &PythonWorker, class: &'static str) -> Vec<FieldSpec> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime
        .block_on(worker.run(move |py| -> PyResult<Vec<(String, bool)>> {
            let module = PyModule::from_code(py, DESCRIBE, c"describe.py", c"describe")?;
            module.getattr("describe")?.call1((class,))?.extract()
        }))
        .unwrap()
        .unwrap_or_else(|err| panic!("rollout_sdk.{class}: {err}"))
        .into_iter()
        .map(|(name, optional)| FieldSpec {
            name: Box::leak(name.into_boxed_str()),
            optional,
        })
        .collect()
}

#[test]
fn every_contract_class_has_the_fields_of_its_sdk_dataclass() {
    let worker = python();
    let mut drift = Vec::new();
    for ClassSpec { class, fields } in classes() {
        let sdk = sdk_fields(&worker, class);
        if sdk != fields {
            drift.push(format!(
                "{class}:\n  Rust:   {}\n  Python: {}",
                describe(&fields),
                describe(&sdk)
            ));
        }
    }
    assert!(
        drift.is_empty(),
        "the contract drifted:\n{}",
        drift.join("\n")
    );
}

fn describe(fields: &[FieldSpec]) -> String {
    let names: Vec<String> = fields
        .iter()
        .map(|f| format!("{}{}", f.name, if f.optional { "?" } else { "" }))
        .collect();
    names.join(", ")
}

/// `rollout_sdk.StepMetrics`'s keys as `(name, optional)`, in order.
const METRIC_KEYS: &std::ffi::CStr = c"
import rollout_sdk


def metric_keys():
    metrics = rollout_sdk.StepMetrics
    return [(key, key in metrics.__optional_keys__) for key in metrics.__annotations__]
";

#[test]
fn the_metrics_line_has_the_keys_of_the_sdks_step_metrics() {
    let worker = python();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let sdk: Vec<(String, bool)> = runtime
        .block_on(worker.run(|py| -> PyResult<Vec<(String, bool)>> {
            let module = PyModule::from_code(py, METRIC_KEYS, c"metric_keys.py", c"metric_keys")?;
            module.getattr("metric_keys")?.call0()?.extract()
        }))
        .unwrap()
        .unwrap();
    let rust: Vec<(String, bool)> = StepMetrics::FIELDS
        .iter()
        .map(|field| (field.name.to_owned(), field.optional))
        .collect();
    assert_eq!(
        rust, sdk,
        "rollout_core::metrics::StepMetrics vs rollout_sdk.StepMetrics"
    );
}

/// Rewards in the sandbox receive the engine's `ScoreSample` as JSON and build a
/// `rollout_sdk.Sample` from its fields as they are.
#[test]
fn samples_sent_to_the_sandbox_have_the_fields_of_the_sdks_sample() {
    let sample = ScoreSample {
        prompt: "1+1=".into(),
        completion: "2".into(),
        record: serde_json::json!({ "answer": "2" }),
        finish_reason: FinishReason::Stop,
    };
    let sent: BTreeSet<String> = match serde_json::to_value(&sample).unwrap() {
        serde_json::Value::Object(fields) => fields.keys().cloned().collect(),
        other => panic!("{other}"),
    };
    let sdk: BTreeSet<String> = sdk_fields(&python(), "Sample")
        .into_iter()
        .map(|field| field.name.to_owned())
        .collect();
    assert_eq!(sent, sdk);
}

/// A reward's `SampleFailure` names one of the engine's failure reasons (all but `restarted`,
/// which only the environment pool gives).
#[test]
fn sample_failure_reasons_are_the_engines() {
    const REASONS: &std::ffi::CStr = c"
import typing

import rollout_sdk.reward


def reasons():
    return list(typing.get_args(rollout_sdk.reward.FailureReason))
";
    let worker = python();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let sdk: Vec<String> = runtime
        .block_on(worker.run(|py| -> PyResult<Vec<String>> {
            let module = PyModule::from_code(py, REASONS, c"reasons.py", c"reasons")?;
            module.getattr("reasons")?.call0()?.extract()
        }))
        .unwrap()
        .unwrap();
    let engine: Vec<String> = FailureReason::ALL
        .into_iter()
        .filter(|reason| *reason != FailureReason::Restarted)
        .map(|reason| reason.as_str().to_owned())
        .collect();
    assert_eq!(sdk, engine);
}
