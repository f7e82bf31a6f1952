pub mod error;
pub mod github;
pub mod ipam;
pub mod metrics;
pub mod runnerpool;
pub mod scheduler;
pub mod vm;
pub mod webhook;
