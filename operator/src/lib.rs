
pub mod github;
