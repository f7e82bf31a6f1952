//! The state every part of the simulator shares: its configuration, the model, the scale sets
//! and the webhook queue. Its own module so the parts it serves (server, webhooks, scale sets)
//! import it without importing the module that wires them.

use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::mpsc;

use super::config::SimConfig;
use super::jobs::{JobSpec, SimJob};
use super::keys::AppKey;
use super::model::Model;
use super::payload::{self, HookEvent};
use super::scaleset;

pub(crate) struct Shared {
    pub config: SimConfig,
    pub key: Arc<AppKey>,
    pub base_url: String,
    pub model: Mutex<Model>,
    /// Runner scale sets (`scaleset.rs`); when both are held, the model is locked first.
    pub scalesets: Mutex<scaleset::ScaleSets>,
    pub hooks: mpsc::UnboundedSender<HookEvent>,
}

impl Shared {
    pub fn model(&self) -> MutexGuard<'_, Model> {
        self.model.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The URL written into JIT configs (see [`SimConfig::runner_url`]).
    pub fn runner_url(&self) -> String {
        self.config
            .runner_url
            .clone()
            .unwrap_or_else(|| self.base_url.clone())
    }

    pub fn scalesets(&self) -> MutexGuard<'_, scaleset::ScaleSets> {
        self.scalesets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a `workflow_job` webhook for the job's current state, and the scale-set message of
    /// the change when a scale set serves the job.
    pub fn emit(&self, job: &SimJob, action: &str) {
        self.scalesets().on_job(job, action);
        let payload = payload::workflow_job_payload(
            job,
            action,
            &self.config.org,
            self.config.installation_id,
        );
        let _ = self.hooks.send(HookEvent {
            action: action.into(),
            job_id: job.id,
            payload,
        });
    }

    pub fn queue_job(&self, spec: JobSpec) -> SimJob {
        let job = {
            let mut m = self.model();
            let id = m.next_job_id;
            m.next_job_id += 1;
            let default_repo = self.config.repos.first().cloned().unwrap_or_default();
            let job = SimJob::queued(id, spec, &default_repo);
            m.jobs.insert(id, job.clone());
            job
        };
        self.emit(&job, "queued");
        job
    }
}
