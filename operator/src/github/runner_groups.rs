//! Runner groups resolved by name (paginated, cached); the default group when no name is given.

use serde::Deserialize;

use super::client::GithubApp;
use super::errors::{GithubError, Operation};
use super::scope::RunnerScope;

/// The default runner group's id (repository runners are always in it).
pub const DEFAULT_RUNNER_GROUP_ID: u64 = 1;

#[derive(Debug, Clone, Deserialize)]
pub struct RunnerGroup {
    pub id: u64,
    pub name: String,
    #[serde(default)]
    pub default: bool,
}

/// Upper bound on pages followed (100 per page).
const MAX_PAGES: usize = 100;

impl GithubApp {
    /// The id of runner group `name` (or of the default group when `None`) for `scope`.
    /// Organization lookups are cached per (org, name).
    pub async fn runner_group_id(
        &self,
        scope: &RunnerScope,
        name: Option<&str>,
    ) -> Result<u64, GithubError> {
        let org = match scope {
            RunnerScope::Organization { org } => org,
            RunnerScope::Repository { .. } => {
                return match name {
                    None => Ok(DEFAULT_RUNNER_GROUP_ID),
                    Some(n) if n.eq_ignore_ascii_case("default") => Ok(DEFAULT_RUNNER_GROUP_ID),
                    Some(n) => Err(GithubError::InvalidRequest(format!(
                        "runner group `{n}` requested for {scope}: runner groups exist only at organization scope"
                    ))),
                };
            }
            RunnerScope::Enterprise { .. } => return Err(GithubError::EnterpriseScopeUnsupported),
        };
        let key = (org.to_ascii_lowercase(), name.unwrap_or("").to_string());
        if let Some(id) = self
            .inner
            .groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            return Ok(*id);
        }
        let groups = self.list_runner_groups(scope).await?;
        let found = match name {
            None => groups.iter().find(|g| g.default),
            Some(n) => groups
                .iter()
                .find(|g| g.name == n)
                .or_else(|| groups.iter().find(|g| g.name.eq_ignore_ascii_case(n))),
        };
        let Some(group) = found else {
            return Err(self.record(GithubError::RunnerGroupNotFound {
                org: org.clone(),
                name: name.unwrap_or("(default)").to_string(),
            }));
        };
        self.inner
            .groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, group.id);
        Ok(group.id)
    }

    /// All runner groups of the organization (every page).
    pub async fn list_runner_groups(
        &self,
        scope: &RunnerScope,
    ) -> Result<Vec<RunnerGroup>, GithubError> {
        let ctx = scope.context(Operation::ListRunnerGroups, self.installation_id(), false);
        let path = format!("{}/runner-groups?per_page=100", scope.actions_path()?);
        self.get_all_pages(&ctx, path, "runner_groups", MAX_PAGES)
            .await
    }
}
