
pub mod github;
pub mod error;
pub mod metrics;
pub mod scheduler;
pub mod vm;
pub mod runnerpool;
pub mod webhook;
