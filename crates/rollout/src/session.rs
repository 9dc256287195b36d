//! Setting up a run in this process: the config's interpreter, its policy (or each agent's
//! policy in a multi-agent run), the services (data, rewards, environment, callbacks) and the
//! data, shared by `run`, `check` and `generate`.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use rollout_core::config::LoadedConfig;
use rollout_core::roles::{Generator, Learner, Observer, Record, RoleError, Tokenizer};
use rollout_core::telemetry::{Observed, Telemetry};
use rollout_core::train::{
    Agent, Controller, PolicyRoles, Roles, RunError, Start, Summary, Team, Trainees,
};
use rollout_python::HostError;
use rollout_python::hosts::{OverlappedPolicy, PolicyHost, Services};
use rollout_python::interpreter::{PythonError, PythonWorker};
use tracing::Instrument;

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Python(#[from] PythonError),
    #[error(transparent)]
    Host(#[from] HostError),
    #[error(transparent)]
    Role(#[from] RoleError),
    #[error(transparent)]
    Run(#[from] RunError),
}

/// An agent's name, learning rate and policy.
pub struct AgentHost {
    pub name: String,
    pub learning_rate: f64,
    pub policy: PolicyHost,
}

/// The policies a run trains.
enum Policies {
    One(Box<PolicyHost>),
    /// One policy whose generation overlaps its training, on a copy of its own.
    Overlapped(Box<OverlappedPolicy>),
    Team(Vec<AgentHost>),
}

/// What a session is opened for: only training overlaps generation with it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    Train,
    Sample,
}

/// A config with its plugins loaded and its data read.
pub struct Session {
    pub loaded: LoadedConfig,
    policies: Policies,
    pub services: Services,
    pub records: Vec<Record>,
}

impl Session {
    pub async fn open(loaded: LoadedConfig, purpose: Purpose) -> Result<Self, SessionError> {
        let worker = rollout_python::interpreter::start(&loaded.config.python).await?;
        let policies = if loaded.config.multi_agent() {
            let mut agents = Vec::new();
            for spec in loaded.config.agent_specs() {
                let policy = PolicyHost::load_policy(
                    worker.clone(),
                    &loaded,
                    spec.policy_key.clone(),
                    spec.policy.clone(),
                )
                .instrument(tracing::info_span!("policy.load", agent = spec.name))
                .await?;
                agents.push(AgentHost {
                    name: spec.name.to_owned(),
                    learning_rate: spec.learning_rate,
                    policy,
                });
            }
            Policies::Team(agents)
        } else if purpose == Purpose::Train && loaded.config.overlaps_generation_in_process() {
            let policy = OverlappedPolicy::load(worker.clone(), &loaded).await?;
            Policies::Overlapped(Box::new(policy))
        } else {
            let policy = PolicyHost::load(worker.clone(), &loaded)
                .instrument(tracing::info_span!("policy.load"))
                .await?;
            Policies::One(Box::new(policy))
        };
        let (services, records) = open_services(worker, &loaded).await?;
        Ok(Session {
            loaded,
            policies,
            services,
            records,
        })
    }

    /// What `rollout check` prints: every plugin loaded and the data read and tokenised, and
    /// (one policy) a group of the first prompt sampled and scored.
    pub async fn report(&self) -> Result<String, SessionError> {
        match &self.policies {
            Policies::One(policy) => self.policy_report(policy).await,
            Policies::Overlapped(policy) => self.policy_report(policy.learner()).await,
            Policies::Team(agents) => self.team_report(agents).await,
        }
    }
    async fn policy_report(&self, policy: &PolicyHost) -> Result<String, SessionError> {
        let prompts: Vec<String> = self.records.iter().map(|r| r.prompt.clone()).collect();
        let encoded = policy.encode(prompts, false).await?;
        let longest = encoded.iter().map(Vec::len).max().unwrap_or(0);
        self.check_sft_records()?;
        let described = policy.describe().await?;
        let mut lines = self.setup_lines(policy.spec(), &described, longest);
        lines.extend(self.dry_run_lines().await?);
        Ok(lines.join("\n"))
    }

    /// `[sft]` trains on every record's completion: each must have one.
    fn check_sft_records(&self) -> Result<(), SessionError> {
        let Some(sft) = &self.loaded.config.sft else {
            return Ok(());
        };
        match self
            .records
            .iter()
            .position(|r| r.fields.get(&sft.completion_key).is_none())
        {
            Some(index) => Err(RunError::Data(format!(
                "[sft] needs `{}` in every record, but record {index} has none",
                sft.completion_key
            ))
            .into()),
            None => Ok(()),
        }
    }

    /// The config's policy, data, rewards, environment and callbacks, as loaded.
    fn setup_lines(
        &self,
        spec: &str,
        described: &serde_json::Value,
        longest_prompt: usize,
    ) -> Vec<String> {
        let config = &self.loaded.config;
        let rewards: Vec<String> = config
            .rewards
            .iter()
            .map(|r| format!("{} x {}", rollout_core::config::reward_name(r), r.weight))
            .collect();
        let mut lines = vec![
            format!("config OK: {}", self.loaded.path.display()),
            format!("  policy       {spec} {described}"),
            format!(
                "  data         {} records, longest prompt {longest_prompt} tokens, first prompt {:?}",
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
        lines
    }

    /// A dry run's completions of the first prompt and their rewards, and a step's size.
    async fn dry_run_lines(&self) -> Result<[String; 2], SessionError> {
        let config = &self.loaded.config;
        let observer: &dyn Observer = &self.services;
        let dry_run = Controller::new(
            config,
            self.roles(observer)?,
            self.records.clone(),
            Arc::new(AtomicBool::new(false)),
        )
        .dry_run()
        .await?;
        let reward_mean = dry_run.rewards.iter().sum::<f64>() / dry_run.rewards.len().max(1) as f64;
        Ok([
            format!(
                "  sampled      {} completions of the first prompt ({} tokens, {:.1}s), reward mean {reward_mean:.3}, e.g. {:?}",
                dry_run.completions.len(),
                dry_run.generated_tokens,
                dry_run.seconds,
                dry_run
                    .completions
                    .first()
                    .map(String::as_str)
                    .unwrap_or_default(),
            ),
            format!(
                "  per step     {} prompts x {} completions, up to {} new tokens each",
                config.rollout.prompts_per_step,
                config.rollout.group_size,
                config.rollout.max_new_tokens
            ),
        ])
    }

    /// What `rollout check` prints for a multi-agent run: every agent's policy, the data and
    /// the environment, all loaded.
    async fn team_report(&self, agents: &[AgentHost]) -> Result<String, SessionError> {
        let config = &self.loaded.config;
        let mut lines = vec![format!("config OK: {}", self.loaded.path.display())];
        for agent in agents {
            let described = agent.policy.describe().await?;
            lines.push(format!(
                "  agent {:<10} {} {described} (learning rate {})",
                agent.name,
                agent.policy.spec(),
                agent.learning_rate
            ));
        }
        lines.push(format!(
            "  data         {} records, first prompt {:?}",
            self.records.len(),
            self.records
                .first()
                .map(|r| r.prompt.as_str())
                .unwrap_or_default()
        ));
        if let Some(environment) = &config.environment {
            lines.push(format!(
                "  environment  {} (max {} turns)",
                environment.plugin, environment.max_turns
            ));
        }
        lines.push(format!("  callbacks    {}", config.callbacks.len()));
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
        let observer: &dyn Observer = &self.services;
        let mut controller = Controller::new(
            config,
            self.roles(observer)?,
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
        let team;
        let trainees = match &self.policies {
            Policies::One(policy) => Trainees::Policy(self.policy_roles(policy.as_ref())),
            Policies::Overlapped(policy) => Trainees::Policy(self.policy_roles(policy.as_ref())),
            Policies::Team(agents) => {
                team = self.team(agents)?;
                Trainees::Team(&team)
            }
        };
        let roles = Roles {
            trainees,
            observer: &observer,
        };
        let mut controller = Controller::new(config, roles, self.records.clone(), interrupted);
        let result = controller.run(start).await;
        controller.finish(result.as_ref().ok()).await;
        Ok(result?)
    }

    /// The roles of a single-policy run (for `check` and `generate`).
    fn roles<'s>(&'s self, observer: &'s dyn Observer) -> Result<Roles<'s>, SessionError> {
        match &self.policies {
            Policies::One(policy) => Ok(Roles {
                trainees: Trainees::Policy(self.policy_roles(policy.as_ref())),
                observer,
            }),
            Policies::Overlapped(policy) => Ok(Roles {
                trainees: Trainees::Policy(self.policy_roles(policy.learner())),
                observer,
            }),
            Policies::Team(_) => Err(RunError::Data(
                "a multi-agent run is sampled only while it trains".into(),
            )
            .into()),
        }
    }

    fn policy_roles<'s, P>(&'s self, policy: &'s P) -> PolicyRoles<'s>
    where
        P: Generator + Learner + Tokenizer,
    {
        PolicyRoles {
            generator: policy,
            learner: policy,
            tokenizer: policy,
            scorer: &self.services,
            environments: if self.services.has_environment() {
                Some(&self.services)
            } else {
                None
            },
        }
    }

    fn team<'s>(&'s self, agents: &'s [AgentHost]) -> Result<Team<'s>, SessionError> {
        let environments = self.services.multi_agent().ok_or_else(|| {
            RoleError::Protocol("a multi-agent run without a multi-agent environment".into())
        })?;
        Ok(Team {
            agents: agents
                .iter()
                .map(|agent| Agent {
                    name: agent.name.clone(),
                    generator: &agent.policy,
                    learner: &agent.policy,
                    tokenizer: &agent.policy,
                    learning_rate: agent.learning_rate,
                })
                .collect(),
            environments,
        })
    }
}

/// What `rollout run` and `rollout launch` print at the end of a run.
pub fn format_summary(summary: &Summary) -> String {
    let mut lines = vec![format!(
        "done: {} steps in {:.1}s",
        summary.steps_completed, summary.wall_seconds
    )];
    if let (Some(first), Some(last)) = (summary.first_rewards_mean, summary.last_rewards_mean) {
        lines.push(format!(
            "reward_mean: first 10 steps {first:.3}, last 10 steps {last:.3} ({:+.3})",
            last - first
        ));
    }
    if let Some(checkpoint) = &summary.checkpoint {
        lines.push(format!("checkpoint: {}", checkpoint.display()));
    }
    lines.join("\n")
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
