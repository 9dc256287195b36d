//! Colocated workers: the device memory generation holds, released while the trainers step
//! on the same devices and taken back before the next generation.

use std::sync::Arc;

use rollout_net::messages::{Done, GeneratorMemory};

use super::{Shared, is_loss, lock};
use crate::cluster::remote::send;
use crate::roles::RoleError;

impl Shared {
    /// Tells every live worker to `action` its memory and waits for all of them; a worker
    /// lost meanwhile leaves the pool. Nothing is sent unless the workers are colocated.
    pub(super) async fn set_memory(
        self: &Arc<Self>,
        action: GeneratorMemory,
    ) -> Result<(), RoleError> {
        if !self.settings.colocated {
            return Ok(());
        }
        let members = lock(&self.members).clone();
        let calls: Vec<_> = members
            .iter()
            .map(|member| (member.clone(), send::<_, Done>(&member.client, &action)))
            .collect();
        for (member, call) in calls {
            match call.await {
                Ok(Done {}) => {}
                Err(err) if is_loss(&err) => self.lose(&member, &err),
                Err(err) => {
                    return Err(RoleError::Protocol(format!(
                        "{} could not {} its memory: {err}",
                        member.name,
                        match action {
                            GeneratorMemory::Release => "release",
                            GeneratorMemory::Restore => "restore",
                        }
                    )));
                }
            }
        }
        Ok(())
    }
}
