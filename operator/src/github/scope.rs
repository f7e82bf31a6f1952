//! Where runners are registered.

use super::errors::{CallContext, GithubError, Operation};

/// A runner registration scope.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RunnerScope {
    /// Organization runners (App permission `organization_self_hosted_runners`).
    Organization { org: String },
    /// Repository runners (App permission `administration`).
    Repository { owner: String, repo: String },
    /// Enterprise runners: refused (GitHub does not accept App installation tokens there).
    Enterprise { enterprise: String },
}

impl RunnerScope {
    pub fn org(org: impl Into<String>) -> Self {
        RunnerScope::Organization { org: org.into() }
    }

    pub fn repo(owner: impl Into<String>, repo: impl Into<String>) -> Self {
        RunnerScope::Repository {
            owner: owner.into(),
            repo: repo.into(),
        }
    }

    /// `/orgs/{org}/actions` or `/repos/{owner}/{repo}/actions`.
    pub(crate) fn actions_path(&self) -> Result<String, GithubError> {
        match self {
            RunnerScope::Organization { org } => Ok(format!("/orgs/{}/actions", segment(org)?)),
            RunnerScope::Repository { owner, repo } => Ok(format!(
                "/repos/{}/{}/actions",
                segment(owner)?,
                segment(repo)?
            )),
            RunnerScope::Enterprise { .. } => Err(GithubError::EnterpriseScopeUnsupported),
        }
    }

    pub(crate) fn context(
        &self,
        operation: Operation,
        installation_id: u64,
        write: bool,
    ) -> CallContext {
        let (target, permission) = match self {
            RunnerScope::Organization { org } => (
                format!("organization `{org}`"),
                if write {
                    "organization_self_hosted_runners=write"
                } else {
                    "organization_self_hosted_runners=read"
                },
            ),
            RunnerScope::Repository { owner, repo } => (
                format!("repository `{owner}/{repo}`"),
                if write {
                    "administration=write"
                } else {
                    "administration=read"
                },
            ),
            RunnerScope::Enterprise { enterprise } => {
                (format!("enterprise `{enterprise}`"), "(unsupported)")
            }
        };
        CallContext {
            operation,
            target,
            permission,
            installation_id,
        }
    }
}

impl std::fmt::Display for RunnerScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunnerScope::Organization { org } => write!(f, "org:{org}"),
            RunnerScope::Repository { owner, repo } => write!(f, "repo:{owner}/{repo}"),
            RunnerScope::Enterprise { enterprise } => write!(f, "enterprise:{enterprise}"),
        }
    }
}

/// A GitHub login or repository name as a path segment (no escaping games).
fn segment(s: &str) -> Result<&str, GithubError> {
    let ok = !s.is_empty()
        && s.len() <= 100
        && s != "."
        && s != ".."
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(s)
    } else {
        Err(GithubError::InvalidRequest(format!(
            "`{s}` is not a valid GitHub owner or repository name"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_rejections() {
        assert_eq!(
            RunnerScope::org("octo-org").actions_path().unwrap(),
            "/orgs/octo-org/actions"
        );
        assert_eq!(
            RunnerScope::repo("o", "r.rs").actions_path().unwrap(),
            "/repos/o/r.rs/actions"
        );
        assert!(matches!(
            RunnerScope::Enterprise {
                enterprise: "e".into()
            }
            .actions_path(),
            Err(GithubError::EnterpriseScopeUnsupported)
        ));
        for bad in ["", "..", "a/b", "a?b", "a b"] {
            assert!(
                matches!(
                    RunnerScope::org(bad).actions_path(),
                    Err(GithubError::InvalidRequest(_))
                ),
                "{bad}"
            );
        }
    }
}
