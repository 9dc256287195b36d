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

/// A micro-batch's per-row staleness and its objective's rollout correction reach the SDK's
/// `TrainBatch` as the dataclass's own field types.
#[test]
fn a_train_batch_carries_row_staleness_and_the_rollout_correction() {
    use rollout_net::messages::{
        CorrectionLevel, CorrectionMode, KlPenalty, MicroBatch, Objective, RolloutCorrection,
    };
    use rollout_python::contract::{TrainBatch, to_python};

    let batch = MicroBatch {
        rows: 2,
        width: 2,
        input_ids: vec![1, 2, 1, 3],
        attention_mask: vec![1; 4],
        loss_mask: vec![0.0, 1.0, 0.0, 1.0],
        advantages: vec![0.0, 1.0, 0.0, -1.0],
        old_logprobs: vec![0.0, -0.5, 0.0, -0.25],
        loss_scale: 0.5,
        objective: Objective::Grpo {
            clip_low: 0.2,
            clip_high: 0.2,
            kl_coef: 0.0,
            temperature: 1.0,
            kl_penalty: KlPenalty::Loss,
            correction: RolloutCorrection {
                mode: CorrectionMode::Mis,
                cap: 3.0,
                band: [0.25, 4.0],
                level: CorrectionLevel::Sequence,
            },
        },
        returns: Vec::new(),
        old_values: Vec::new(),
        row_staleness: vec![0, 2],
    };
    let worker = python();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    type Seen = (Vec<i64>, bool, String, f32, (f32, f32), String);
    let seen: Seen = runtime
        .block_on(worker.run(move |py| -> PyResult<Seen> {
            let train = to_python(py, TrainBatch::from(&batch))?;
            let objective = train.getattr("objective")?;
            Ok((
                train
                    .getattr("row_staleness")?
                    .call_method0("tolist")?
                    .extract()?,
                train.getattr("first_logprobs")?.is_none(),
                objective.getattr("rollout_correction")?.extract()?,
                objective.getattr("rollout_correction_cap")?.extract()?,
                objective.getattr("rollout_correction_band")?.extract()?,
                objective.getattr("rollout_correction_level")?.extract()?,
            ))
        }))
        .unwrap()
        .unwrap();
    assert_eq!(
        seen,
        (
            vec![0, 2],
            true,
            "mis".to_owned(),
            3.0,
            (0.25, 4.0),
            "sequence".to_owned()
        )
    );
}
