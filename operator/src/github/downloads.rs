//! Supported runner versions: `GET {scope}/actions/runners/downloads` lists the runner release
//! GitHub currently offers, per platform (`os, architecture, download_url, filename,
//! sha256_checksum`). The installation token of the pool's App reads it with the permission the
//! pool already needs (organization self-hosted runners, or repository administration, read).
//! Revalidated with its ETag: an unchanged answer is a free 304.

use serde::{Deserialize, Serialize};

use super::client::GithubApp;
use super::conditional::CallCount;
use super::errors::{GithubError, Operation};
use super::scope::RunnerScope;

/// One downloadable runner package.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunnerDownload {
    pub os: String,
    pub architecture: String,
    #[serde(default)]
    pub download_url: String,
    pub filename: String,
    #[serde(default)]
    pub sha256_checksum: Option<String>,
}

/// The version of the Linux x64 package (what Imp's runner layer packs), from its file name
/// (`actions-runner-linux-x64-2.330.0.tar.gz`); None when GitHub lists none.
pub fn newest_linux_x64(downloads: &[RunnerDownload]) -> Option<String> {
    downloads
        .iter()
        .filter(|d| {
            d.os.eq_ignore_ascii_case("linux") && d.architecture.eq_ignore_ascii_case("x64")
        })
        .filter_map(|d| {
            let stem = d.filename.strip_suffix(".tar.gz")?;
            let v = stem.rsplit('-').next()?;
            (v.split('.').count() == 3 && v.split('.').all(|p| p.parse::<u32>().is_ok()))
                .then(|| v.to_string())
        })
        .max_by_key(|v| {
            v.split('.')
                .map(|p| p.parse::<u32>().unwrap_or(0))
                .collect::<Vec<_>>()
        })
}

impl GithubApp {
    /// The runner packages GitHub offers to `scope` (one call; 304 when unchanged).
    pub async fn runner_downloads(
        &self,
        scope: &RunnerScope,
    ) -> Result<Vec<RunnerDownload>, GithubError> {
        let ctx = scope.context(
            Operation::ListRunnerDownloads,
            self.installation_id(),
            false,
        );
        let path = format!("{}/runners/downloads", scope.actions_path()?);
        let resp = self
            .get_revalidated(&ctx, &path, &mut CallCount::default())
            .await?;
        serde_json::from_slice(&resp.body).map_err(|e| {
            self.record(GithubError::Decode {
                operation: Operation::ListRunnerDownloads,
                message: e.to_string(),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(os: &str, arch: &str, file: &str) -> RunnerDownload {
        RunnerDownload {
            os: os.into(),
            architecture: arch.into(),
            download_url: String::new(),
            filename: file.into(),
            sha256_checksum: None,
        }
    }

    #[test]
    fn the_newest_linux_x64_version_is_read_from_the_file_name() {
        let list = vec![
            d("osx", "x64", "actions-runner-osx-x64-2.331.0.tar.gz"),
            d(
                "linux",
                "arm64",
                "actions-runner-linux-arm64-2.331.0.tar.gz",
            ),
            d("linux", "x64", "actions-runner-linux-x64-2.330.0.tar.gz"),
            d("linux", "x64", "actions-runner-linux-x64-2.99.0.tar.gz"),
            d("linux", "x64", "actions-runner-linux-x64-latest.tar.gz"),
        ];
        assert_eq!(newest_linux_x64(&list).as_deref(), Some("2.330.0"));
        assert_eq!(newest_linux_x64(&list[..2]), None);
        let json = r#"[{"os":"linux","architecture":"x64","download_url":"u",
            "filename":"actions-runner-linux-x64-2.329.0.tar.gz","sha256_checksum":"ab"}]"#;
        let parsed: Vec<RunnerDownload> = serde_json::from_str(json).unwrap();
        assert_eq!(newest_linux_x64(&parsed).as_deref(), Some("2.329.0"));
    }
}
