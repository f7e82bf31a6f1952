//! Runner releases as the simulator's GitHub knows them: the newest release (what
//! `GET .../actions/runners/downloads` lists) and the broker's version check. A runner older than
//! the configured minimum is refused at connect with GitHub's message, "Runner version vX is
//! deprecated and cannot receive messages." (403), as GitHub's enforcement does; `refuse_all`
//! refuses every version, the newest too (an outage or rollback at GitHub). Pure state; the
//! handlers are in `server.rs`.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The newest runner release the simulator offers by default; the fake runner reports it unless
/// told otherwise (`imp_fake_runner::DEFAULT_RUNNER_VERSION`).
pub const DEFAULT_LATEST: &str = imp_fake_runner::DEFAULT_RUNNER_VERSION;

/// The simulator's runner release state.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunnerReleases {
    /// The newest release (`MAJOR.MINOR.PATCH`).
    pub latest: String,
    /// Runners older than this are refused as deprecated (None: no enforcement).
    pub minimum: Option<String>,
    /// Every runner is refused as deprecated, the newest too.
    pub refuse_all: bool,
    /// Runners refused so far.
    pub refusals: u64,
    /// `downloads` calls answered.
    pub downloads_calls: u64,
}

impl Default for RunnerReleases {
    fn default() -> Self {
        RunnerReleases {
            latest: DEFAULT_LATEST.to_string(),
            minimum: None,
            refuse_all: false,
            refusals: 0,
            downloads_calls: 0,
        }
    }
}

fn parse(v: &str) -> Option<(u32, u32, u32)> {
    let v = v.trim().trim_start_matches('v');
    let mut it = v.split('.').map(|p| p.parse::<u32>().ok());
    Some((it.next()??, it.next()??, it.next()??))
}

impl RunnerReleases {
    /// The broker's check of a connecting runner's version: `Err(message)` when refused. A runner
    /// that states no version is taken as the newest (older fake runners did not send one).
    pub fn check(&mut self, version: Option<&str>) -> Result<(), String> {
        let version = version.unwrap_or(&self.latest).to_string();
        let too_old = match (&self.minimum, parse(&version)) {
            (Some(min), Some(v)) => parse(min).is_some_and(|m| v < m),
            (Some(_), None) => true,
            (None, _) => false,
        };
        if too_old || self.refuse_all {
            self.refusals += 1;
            return Err(format!(
                "Runner version v{} is deprecated and cannot receive messages.",
                version.trim_start_matches('v')
            ));
        }
        Ok(())
    }

    /// GitHub's `downloads` answer: the newest release for each platform.
    pub fn downloads(&mut self) -> Value {
        self.downloads_calls += 1;
        let v = &self.latest;
        let files: Vec<Value> = [
            ("linux", "x64", "tar.gz"),
            ("linux", "arm64", "tar.gz"),
            ("osx", "x64", "tar.gz"),
            ("win", "x64", "zip"),
        ]
        .iter()
        .map(|(os, arch, ext)| {
            let filename = format!("actions-runner-{os}-{arch}-{v}.{ext}");
            json!({
                "os": os,
                "architecture": arch,
                "download_url": format!("https://github.com/actions/runner/releases/download/v{v}/{filename}"),
                "filename": filename,
                "sha256_checksum": format!("{:064x}", fxhash(&filename)),
            })
        })
        .collect();
        Value::Array(files)
    }
}

/// A stable stand-in checksum (the simulator serves no files).
fn fxhash(s: &str) -> u128 {
    s.bytes().fold(0xcbf29ce484222325u128, |h, b| {
        (h ^ u128::from(b)).wrapping_mul(0x100000001b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runners_below_the_minimum_are_refused_with_githubs_message() {
        let mut r = RunnerReleases {
            latest: "2.330.0".into(),
            minimum: Some("2.329.0".into()),
            ..Default::default()
        };
        assert!(r.check(Some("2.329.0")).is_ok());
        assert!(r.check(Some("2.330.0")).is_ok());
        assert!(r.check(None).is_ok(), "no version stated: the newest");
        let msg = r.check(Some("2.328.5")).unwrap_err();
        assert_eq!(
            msg,
            "Runner version v2.328.5 is deprecated and cannot receive messages."
        );
        assert!(r.check(Some("garbage")).is_err());
        assert_eq!(r.refusals, 2);
        r.refuse_all = true;
        assert!(
            r.check(Some("2.330.0")).is_err(),
            "an outage refuses the newest too"
        );
    }

    #[test]
    fn downloads_list_the_newest_release_per_platform() {
        let mut r = RunnerReleases {
            latest: "2.331.0".into(),
            ..Default::default()
        };
        let d = r.downloads();
        let linux = d
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["os"] == "linux" && f["architecture"] == "x64")
            .unwrap();
        assert_eq!(linux["filename"], "actions-runner-linux-x64-2.331.0.tar.gz");
        assert_eq!(linux["sha256_checksum"].as_str().unwrap().len(), 64);
        assert_eq!(r.downloads_calls, 1);
    }
}
