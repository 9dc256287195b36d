//! Setting up a multi-agent run (`[agents]`): one policy per agent on the embedded
//! interpreter, the services (data, environment, callbacks) and the data.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use tracing::Instrument;

use crate::config::LoadedConfig;
use crate::local::{PolicyHost, Services};
use crate::plugins::Record;
use crate::roles::{Observer, RoleError};
use crate::session::{SessionError, open_services, start_python};
use crate::telemetry::{Observed, Telemetry};
use crate::train::{Agent, MultiAgentController, Start, Summary, Team};

/// An agent's name, learning rate and policy.
pub struct AgentHost {
    pub name: String,
    pub learning_rate: f64,
    pub policy: PolicyHost,
}

pub struct TeamSession {
    pub loaded: LoadedConfig,
    pub agents: Vec<AgentHost>,
    pub services: Services,
    pub records: Vec<Record>,
}

impl TeamSession {
    pub async fn open(loaded: LoadedConfig) -> Result<Self, SessionError> {
        let worker = start_python(&loaded).await?;
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
        let (services, records) = open_services(worker, &loaded).await?;
        Ok(TeamSession {
            loaded,
            agents,
            services,
            records,
        })
    }

    fn team<'s>(&'s self, observer: &'s dyn Observer) -> Result<Team<'s>, SessionError> {
        let environments = self.services.multi_agent().ok_or_else(|| {
            RoleError::Protocol("a multi-agent run without a multi-agent environment".into())
        })?;
        Ok(Team {
            agents: self
                .agents
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
            observer,
        })
    }

    /// What `rollout check` prints for a multi-agent run: every agent's policy, the data and
    /// the environment, all loaded.
    pub async fn report(&self) -> Result<String, SessionError> {
        let config = &self.loaded.config;
        let mut lines = vec![format!("config OK: {}", self.loaded.path.display())];
        for agent in &self.agents {
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
        let team = self.team(&observer)?;
        let mut controller =
            MultiAgentController::new(config, team, self.records.clone(), interrupted);
        let result = controller.run(start).await;
        controller.finish(result.as_ref().ok()).await;
        Ok(result?)
    }
}
