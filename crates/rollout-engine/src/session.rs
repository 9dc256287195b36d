//! Setting up a run: config, interpreter, plugins and data, shared by `run` and `check`.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use tracing::Instrument;

use crate::config::LoadedConfig;
use crate::local::{LocalError, PolicyHost, Services};
use crate::plugins::Record;
use crate::python::{PythonError, PythonSetup, PythonWorker};
use crate::roles::{RoleError, Tokenizer};
use crate::telemetry::{Observed, Telemetry};
use crate::train::{Controller, Roles, RunError, Start, Summary};

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Python(#[from] PythonError),
    #[error(transparent)]
    Local(#[from] LocalError),
    #[error(transparent)]
    Role(#[from] RoleError),
    #[error(transparent)]
    Run(#[from] RunError),
}

/// A config with its plugins loaded and its data read.
pub struct Session {
    pub loaded: LoadedConfig,
    pub policy: PolicyHost,
    pub services: Services,
    pub records: Vec<Record>,
}

impl Session {
    pub async fn open(loaded: LoadedConfig) -> Result<Self, SessionError> {
        let worker = start_python(&loaded).await?;
        let policy = PolicyHost::load(worker.clone(), &loaded)
            .instrument(tracing::info_span!("policy.load"))
            .await?;
        let (services, records) = open_services(worker, &loaded).await?;
        Ok(Session {
            loaded,
            policy,
            services,
            records,
        })
    }

    fn roles(&self) -> Roles<'_> {
        Roles {
            generator: &self.policy,
            scorer: &self.services,
            learner: &self.policy,
            tokenizer: &self.policy,
            environments: if self.services.has_environment() {
                Some(&self.services)
            } else {
                None
            },
            observer: &self.services,
        }
    }

    /// What `rollout check` prints: every plugin loaded and the data read and tokenised.
    pub async fn report(&self) -> Result<String, SessionError> {
        let config = &self.loaded.config;
        let prompts: Vec<String> = self.records.iter().map(|r| r.prompt.clone()).collect();
        let encoded = self.policy.encode(prompts, false).await?;
        let longest = encoded.iter().map(Vec::len).max().unwrap_or(0);
        if let Some(sft) = &config.sft {
            if let Some(index) = self
                .records
                .iter()
                .position(|r| r.fields.get(&sft.completion_key).is_none())
            {
                return Err(RunError::Data(format!(
                    "[sft] needs `{}` in every record, but record {index} has none",
                    sft.completion_key
                ))
                .into());
            }
        }
        let policy = self.policy.describe().await?;
        let rewards: Vec<String> = config
            .rewards
            .iter()
            .map(|r| format!("{} x {}", crate::config::reward_name(r), r.weight))
            .collect();
        let mut lines = vec![
            format!("config OK: {}", self.loaded.path.display()),
            format!("  policy       {} {policy}", self.policy.spec()),
            format!(
                "  data         {} records, longest prompt {longest} tokens, first prompt {:?}",
                self.records.len(),
                self.records
                    .first()
                    .map(|r| r.prompt.as_str())
                    .unwrap_or_default()
            ),
            format!(
                "  rewards      {}",
                if rewards.is_empty() {
                    "none".into()
                } else {
                    rewards.join(", ")
                }
            ),
        ];
        if let Some(environment) = &config.environment {
            lines.push(format!(
                "  environment  {} (max {} turns)",
                environment.plugin, environment.max_turns
            ));
        }
        lines.push(format!("  callbacks    {}", config.callbacks.len()));
        let dry_run = Controller::new(
            config,
            self.roles(),
            self.records.clone(),
            Arc::new(AtomicBool::new(false)),
        )
        .dry_run()
        .await?;
        let reward_mean = dry_run.rewards.iter().sum::<f64>() / dry_run.rewards.len().max(1) as f64;
        lines.push(format!(
            "  sampled      {} completions of the first prompt ({} tokens, {:.1}s), reward mean {reward_mean:.3}, e.g. {:?}",
            dry_run.completions.len(),
            dry_run.generated_tokens,
            dry_run.seconds,
            dry_run.completions.first().map(String::as_str).unwrap_or_default(),
        ));
        lines.push(format!(
            "  per step     {} prompts x {} completions, up to {} new tokens each",
            config.rollout.prompts_per_step,
            config.rollout.group_size,
            config.rollout.max_new_tokens
        ));
        Ok(lines.join("\n"))
    }

    /// Completes the data's prompts without training; writes one JSON line per completion to
    /// `output` (if given) and returns the generation statistics.
    pub async fn generate(
        &self,
        limit: Option<usize>,
        output: Option<&std::path::Path>,
    ) -> Result<serde_json::Value, SessionError> {
        let config = &self.loaded.config;
        let mut controller = Controller::new(
            config,
            self.roles(),
            self.records.clone(),
            Arc::new(AtomicBool::new(false)),
        );
        let generated = controller.generate_all(limit).await?;
        let completions: Vec<_> = generated.response.groups.iter().flatten().collect();
        let tokens: usize = completions.iter().map(|c| c.token_ids.len()).sum();
        if let Some(path) = output {
            let mut lines = String::new();
            let mut texts = generated.texts.iter();
            for (prompt, group) in generated.response.groups.iter().enumerate() {
                for (sample, completion) in group.iter().enumerate() {
                    let line = serde_json::json!({
                        "prompt_index": prompt,
                        "sample": sample,
                        "prompt": self.records[prompt].prompt,
                        "completion": texts.next(),
                        "token_ids": completion.token_ids,
                        "logprobs": completion.logprobs,
                        "finish_reason": completion.finish_reason,
                    });
                    lines.push_str(&line.to_string());
                    lines.push('\n');
                }
            }
            std::fs::write(path, lines).map_err(|source| RunError::Io {
                context: "cannot write",
                path: path.to_path_buf(),
                source,
            })?;
        }
        let mut stats = serde_json::Map::new();
        stats.insert("completions".into(), completions.len().into());
        stats.insert("generated_tokens".into(), tokens.into());
        stats.insert("seconds".into(), generated.seconds.into());
        stats.insert(
            "tokens_per_second".into(),
            (tokens as f64 / generated.seconds.max(1e-9)).into(),
        );
        for (name, value) in &generated.response.metrics {
            stats.insert(name.clone(), (*value).into());
        }
        Ok(serde_json::Value::Object(stats))
    }

    /// Runs the training loop; `interrupted` is set by the Ctrl-C handler. Each step's
    /// metrics are published to `telemetry` too, when there is one (`/metrics`).
    pub async fn run(
        self,
        start: Start,
        interrupted: Arc<AtomicBool>,
        telemetry: Option<&Telemetry>,
    ) -> Result<Summary, SessionError> {
        let config = &self.loaded.config;
        let observer = Observed::new(&self.services, telemetry);
        let roles = Roles {
            observer: &observer,
            ..self.roles()
        };
        let mut controller = Controller::new(config, roles, self.records.clone(), interrupted);
        let result = controller.run(start).await;
        controller.finish(result.as_ref().ok()).await;
        Ok(result?)
    }
}

/// Starts the embedded interpreter that `[python]` describes.
pub(crate) async fn start_python(loaded: &LoadedConfig) -> Result<Arc<PythonWorker>, SessionError> {
    let python = &loaded.config.python;
    let setup = PythonSetup::discover(python.venv.as_deref(), &python.paths)?;
    let worker = tokio::task::spawn_blocking(move || PythonWorker::start(setup))
        .await
        .map_err(|err| PythonError::Setup(format!("the Python start-up task failed: {err}")))??;
    Ok(Arc::new(worker))
}

/// Loads every plugin but the policy and reads the data.
pub(crate) async fn open_services(
    worker: Arc<PythonWorker>,
    loaded: &LoadedConfig,
) -> Result<(Services, Vec<Record>), SessionError> {
    let services = Services::load(worker, loaded)
        .instrument(tracing::info_span!("services.load"))
        .await?;
    let records = services.records().await?;
    Ok((services, records))
}
