//! `rollout plan`'s text: per process and device, the peak and its parts.

use std::fmt::Write;

use super::Plan;
use super::estimate::{count, dtype_name, quantization_name};
use super::options::Quantization;

/// Bytes in binary units, e.g. `1.3 GiB`.
pub fn size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// Phase names, shortened for the two common sets.
fn phases(names: &[&str]) -> String {
    match names {
        ["load", "generate", "train", "checkpoint"] => "always".into(),
        ["generate", "train", "checkpoint"] => "after loading".into(),
        _ => names.join(","),
    }
}

/// The plan as text.
pub fn render(plan: &Plan) -> String {
    let mut out = header(plan);
    for role in &plan.roles {
        for device in &role.devices {
            let _ = writeln!(
                out,
                "\n{} on {}: peak {} (during {})",
                role.role,
                device.device,
                size(device.peak_bytes),
                device.peak_phase
            );
            for part in &device.components {
                let _ = writeln!(
                    out,
                    "  {:<24} {:>10}  {:<19} {}",
                    part.name,
                    size(part.bytes),
                    phases(&part.phases),
                    part.detail
                );
            }
        }
    }
    out.push('\n');
    for device in &plan.devices {
        let verdict = match (device.available_bytes, device.fits) {
            (Some(available), Some(fits)) => format!(
                "of {} {}: {}",
                size(available),
                device.available_from,
                if fits { "fits" } else { "DOES NOT FIT" }
            ),
            _ => "(cannot be checked here)".to_owned(),
        };
        let _ = writeln!(
            out,
            "{}: predicted peak {} {verdict}",
            device.device,
            size(device.predicted_peak_bytes)
        );
    }
    for note in &plan.notes {
        let _ = writeln!(out, "note: {note}");
    }
    out
}

/// The config, the model and the step.
fn header(plan: &Plan) -> String {
    let mut out = String::new();
    let processes = match plan.command {
        "run" => "rollout run: one process".to_owned(),
        _ => format!("rollout launch: {} processes", plan.roles.len()),
    };
    let _ = writeln!(
        out,
        "memory plan for {} ({processes}, {})",
        plan.config.display(),
        plan.algorithm
    );
    let model = &plan.model;
    let mut facts = format!(
        "{}, {} parameters, {} on {}",
        model.model_type,
        count(model.parameters),
        dtype_name(model.dtype),
        model.device
    );
    if model.lora_rank > 0 {
        let _ = write!(facts, ", LoRA rank {}", model.lora_rank);
    }
    if model.quantization != Quantization::None {
        let _ = write!(facts, ", {} base", quantization_name(model.quantization));
    }
    let _ = write!(facts, "; {} trainable", count(model.trainable_parameters));
    let _ = writeln!(out, "model: {} ({facts})", model.path.display());
    let w = &plan.workload;
    if w.samples {
        let _ = writeln!(
            out,
            "step: {} prompts x {} samples, {} prompt + {} completion tokens each",
            w.prompts, w.group_size, w.prompt_tokens, w.completion_tokens
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::size;

    #[test]
    fn sizes_read_well() {
        assert_eq!(size(512), "512 B");
        assert_eq!(size(1536), "1.5 KiB");
        assert_eq!(size(690 << 20), "690.0 MiB");
        assert_eq!(size(3 << 30), "3.0 GiB");
    }
}
