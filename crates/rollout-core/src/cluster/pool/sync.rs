//! Weight versions to the pool: a relay chain of the live workers, with a straight pull
//! from the trainer for a worker whose source left.

use std::future::Future;
use std::sync::Arc;

use rollout_net::messages::{Done, SealWeights, SyncWeights, WeightsReport};

use super::{Member, Shared, is_loss, lock};
use crate::cluster::remote::send;
use crate::roles::{Publication, RoleError, RoleFuture};

impl Shared {
    /// Sends the announced version along a chain of the live workers now (so the sync
    /// reaches each worker before any generation asked for later), then, once the learner
    /// has sealed it, its checksum to each of them: a worker pulls at once but serves the
    /// version only once it matches the seal. A worker whose pull fails because its source
    /// left is then sent straight to the trainer's copy. Workers lost on the way leave the
    /// pool.
    pub(super) fn load_weights(
        self: &Arc<Self>,
        publication: Publication,
    ) -> impl Future<Output = Result<Vec<WeightsReport>, RoleError>> + Send + 'static {
        let Publication { announced, sealed } = publication;
        let members = {
            let members = lock(&self.members);
            self.latest.send_replace(Some(announced.clone()));
            members.clone()
        };
        let mut source = announced.source.clone();
        let calls: Vec<_> = members
            .iter()
            .map(|member| {
                member.sent_version(announced.version);
                let request = SyncWeights {
                    weights: WeightsReport {
                        source: std::mem::replace(&mut source, member.weights_address()),
                        ..announced.clone()
                    },
                };
                let answer: RoleFuture<'static, WeightsReport> =
                    Box::pin(send(&member.client, &request));
                (member.clone(), answer)
            })
            .collect();
        let sealing = self.start_sealing(members, announced.clone(), sealed);
        let shared = self.clone();
        async move {
            let weights = sealing.await.map_err(|err| {
                RoleError::Runtime(format!(
                    "sealing weight version {} stopped: {err}",
                    announced.version
                ))
            })??;
            shared.reports(calls, &weights).await
        }
    }

    /// Waits for the seal of `announced` and hands it to the `members` told to pull it, on a
    /// task of its own: joining workers wait for the seal whether or not the controller is
    /// awaiting the load (with staleness it runs in the background).
    fn start_sealing(
        self: &Arc<Self>,
        members: Vec<Arc<Member>>,
        announced: WeightsReport,
        sealed: RoleFuture<'static, WeightsReport>,
    ) -> tokio::task::JoinHandle<Result<WeightsReport, RoleError>> {
        let shared = self.clone();
        tokio::spawn(async move {
            let weights = sealed.await?;
            if weights.version != announced.version || !weights.is_sealed() {
                return Err(RoleError::Protocol(format!(
                    "weight version {} was announced, but version {} sealed with checksum `{}`",
                    announced.version, weights.version, weights.checksum
                )));
            }
            if !announced.is_sealed() {
                shared.seal(&members, &announced, &weights).await?;
            }
            Ok(weights)
        })
    }

    /// What each member serves once its sync is answered, checked against the sealed
    /// `weights`; a member whose pull failed (not lost) pulls again from the trainer.
    async fn reports(
        &self,
        calls: Vec<(Arc<Member>, RoleFuture<'static, WeightsReport>)>,
        weights: &WeightsReport,
    ) -> Result<Vec<WeightsReport>, RoleError> {
        let mut reports = Vec::with_capacity(calls.len());
        for (member, call) in calls {
            let report = match call.await {
                Ok(report) => report,
                Err(err) if is_loss(&err) => {
                    self.lose(&member, &err);
                    continue;
                }
                Err(err) => {
                    tracing::warn!(
                        "{}: weight version {} failed ({err}); pulling it from the trainer",
                        member.name,
                        weights.version
                    );
                    match self.pull_from_trainer(&member, weights).await? {
                        Some(report) => report,
                        None => continue,
                    }
                }
            };
            verify(&member.name, &report, weights)?;
            reports.push(report);
        }
        Ok(reports)
    }

    /// Makes `weights` (the seal of `announced`) the version joining workers pull, and
    /// sends it to the `members` told to pull `announced`.
    async fn seal(
        &self,
        members: &[Arc<Member>],
        announced: &WeightsReport,
        weights: &WeightsReport,
    ) -> Result<(), RoleError> {
        self.latest.send_if_modified(|latest| {
            let unsealed = latest.as_ref() == Some(announced);
            if unsealed {
                *latest = Some(weights.clone());
            }
            unsealed
        });
        let seal = SealWeights {
            weights: weights.clone(),
        };
        let answers: Vec<_> = members
            .iter()
            .map(|member| (member, send::<_, Done>(&member.client, &seal)))
            .collect();
        for (member, answer) in answers {
            match answer.await {
                Ok(Done {}) => {}
                Err(err) if is_loss(&err) => self.lose(member, &err),
                Err(err) => return Err(err),
            }
        }
        Ok(())
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
