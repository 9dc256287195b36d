//! Weight versions to the pool: a relay chain of the live workers, with a straight pull
//! from the trainer for a worker whose source left.

use std::future::Future;
use std::sync::Arc;

use rollout_net::messages::{SyncWeights, WeightsReport};

use super::{Member, Shared, is_loss, lock};
use crate::cluster::remote::send;
use crate::roles::RoleError;

impl Shared {
    /// Sends `weights` along a chain of the live workers now (so the sync reaches each
    /// worker before any generation asked for later); a worker whose pull fails because its
    /// source left is then sent straight to the trainer's copy. Workers lost on the way
    /// leave the pool.
    pub(super) fn load_weights(
        self: &Arc<Self>,
        weights: WeightsReport,
    ) -> impl Future<Output = Result<Vec<WeightsReport>, RoleError>> + Send + 'static {
        let members = {
            let members = lock(&self.members);
            *lock(&self.latest) = Some(weights.clone());
            members.clone()
        };
        let mut source = weights.source.clone();
        let calls: Vec<_> = members
            .iter()
            .map(|member| {
                member.sent_version(weights.version);
                let request = SyncWeights {
                    weights: WeightsReport {
                        source: std::mem::replace(&mut source, member.weights_address()),
                        ..weights.clone()
                    },
                };
                (
                    member.clone(),
                    send::<_, WeightsReport>(&member.client, &request),
                )
            })
            .collect();
        let shared = self.clone();
        async move {
            let mut reports = Vec::with_capacity(calls.len());
            for (member, call) in calls {
                let report = match call.await {
                    Ok(report) => report,
                    Err(err) if is_loss(&err) => {
                        shared.lose(&member, &err);
                        continue;
                    }
                    Err(err) => {
                        tracing::warn!(
                            "{}: weight version {} failed ({err}); pulling it from the trainer",
                            member.name,
                            weights.version
                        );
                        match shared.pull_from_trainer(&member, &weights).await? {
                            Some(report) => report,
                            None => continue,
                        }
                    }
                };
                verify(&member.name, &report, &weights)?;
                reports.push(report);
            }
            Ok(reports)
        }
    }

    /// Has `member` pull `weights` from the trainer itself; `None` if the member is lost.
    async fn pull_from_trainer(
        &self,
        member: &Arc<Member>,
        weights: &WeightsReport,
    ) -> Result<Option<WeightsReport>, RoleError> {
        let direct = SyncWeights {
            weights: weights.clone(),
        };
        match send::<_, WeightsReport>(&member.client, &direct).await {
            Ok(report) => Ok(Some(report)),
            Err(err) if is_loss(&err) => {
                self.lose(member, &err);
                Ok(None)
            }
            Err(err) => Err(err),
        }
    }
}

pub(super) fn verify(
    name: &str,
    report: &WeightsReport,
    published: &WeightsReport,
) -> Result<(), RoleError> {
    if report.version != published.version || report.checksum != published.checksum {
        return Err(RoleError::Protocol(format!(
            "{name} serves weight version {} with checksum {}, but version {} with checksum {} \
             was published",
            report.version, report.checksum, published.version, published.checksum
        )));
    }
    Ok(())
}
