//! A job's `run:` steps, executed as actions/runner does for the default shell: in order, each
//! script written to a file under `RUNNER_TEMP` and run by `bash -e` when bash is on the PATH,
//! else `sh -e` (GitHub's rule for `shell` unset); `shell: bash` is `bash --noprofile --norc -eo
//! pipefail`, `shell: sh` is `sh -e`. Output goes to the runner's own stdout and stderr (the
//! VM's log). The first failing step fails the job; the steps after it are skipped. Actions
//! (`uses:`) are not run: such a step is reported skipped, saying so.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde::{Deserialize, Serialize};

/// One step as the simulator hands it out with the job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    pub name: String,
    #[serde(default)]
    pub run: Option<String>,
    #[serde(default)]
    pub uses: Option<String>,
    #[serde(default)]
    pub shell: Option<String>,
}

/// How a step ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Success,
    /// Exit code, or `None` when killed by a signal or not started.
    Failure(Option<i32>),
    Skipped,
}

impl Outcome {
    /// The step conclusion GitHub reports.
    pub fn conclusion(self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::Failure(_) => "failure",
            Outcome::Skipped => "skipped",
        }
    }
}

/// The job's conclusion from its steps: `failure` if any step failed, else `success`.
pub fn job_conclusion(outcomes: &[Outcome]) -> &'static str {
    if outcomes.iter().any(|o| matches!(o, Outcome::Failure(_))) {
        "failure"
    } else {
        "success"
    }
}

/// The argv that runs `script` for a step's `shell` (GitHub's templates, `{0}` = the script).
pub fn shell_argv(
    shell: Option<&str>,
    bash_on_path: bool,
    script: &Path,
) -> Result<Vec<String>, String> {
    let file = script.display().to_string();
    let argv: &[&str] = match shell {
        None if bash_on_path => &["bash", "-e"],
        None => &["sh", "-e"],
        Some("bash") => &["bash", "--noprofile", "--norc", "-eo", "pipefail"],
        Some("sh") => &["sh", "-e"],
        Some(other) => {
            return Err(format!(
                "shell {other:?} is not supported by imp-fake-runner (bash or sh)"
            ));
        }
    };
    Ok(argv.iter().map(|s| (*s).to_owned()).chain([file]).collect())
}

/// Whether `program` is an executable file in one of `path_var`'s directories.
pub fn on_path(program: &str, path_var: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path_var.split(':').filter(|d| !d.is_empty()).any(|d| {
        std::fs::metadata(Path::new(d).join(program))
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

/// Where a job runs: actions/runner's layout under the work folder.
#[derive(Debug, Clone)]
pub struct JobDirs {
    /// `<work>/<repo>/<repo>`: GITHUB_WORKSPACE, each step's working directory.
    pub workspace: PathBuf,
    /// `<work>/_temp`: RUNNER_TEMP, where step scripts are written.
    pub temp: PathBuf,
}

impl JobDirs {
    /// The directories for `repository` (`owner/name`) under `work`; created, absolute.
    pub fn create(work: &Path, repository: &str) -> std::io::Result<JobDirs> {
        let name = repository.rsplit('/').next().unwrap_or("repo");
        let dirs = JobDirs {
            workspace: work.join(name).join(name),
            temp: work.join("_temp"),
        };
        std::fs::create_dir_all(&dirs.workspace)?;
        std::fs::create_dir_all(&dirs.temp)?;
        // Absolute: the variables that name them are read from other directories.
        Ok(JobDirs {
            workspace: dirs.workspace.canonicalize()?,
            temp: dirs.temp.canonicalize()?,
        })
    }
}

/// Runs `steps` in order with `env` added to the runner's environment (from which the JIT
/// config variable is removed: a job never sees the runner's credential). Returns each step's
/// outcome.
pub async fn run_steps(steps: &[Step], dirs: &JobDirs, env: &[(String, String)]) -> Vec<Outcome> {
    let path_var = std::env::var("PATH").unwrap_or_default();
    let bash = on_path("bash", &path_var);
    let mut outcomes = Vec::with_capacity(steps.len());
    let total = steps.len();
    for (i, step) in steps.iter().enumerate() {
        let n = i + 1;
        if outcomes.iter().any(|o| matches!(o, Outcome::Failure(_))) {
            println!(
                "imp-fake-runner: step {n}/{total} {:?} skipped: an earlier step failed",
                step.name
            );
            outcomes.push(Outcome::Skipped);
            continue;
        }
        let Some(script) = &step.run else {
            println!(
                "imp-fake-runner: step {n}/{total} {:?} skipped: actions ({}) are not run by imp-fake-runner",
                step.name,
                step.uses.as_deref().unwrap_or("uses")
            );
            outcomes.push(Outcome::Skipped);
            continue;
        };
        println!("imp-fake-runner: step {n}/{total} {:?}", step.name);
        let outcome = run_one(n, script, step.shell.as_deref(), bash, dirs, env).await;
        match outcome {
            Outcome::Failure(Some(code)) => {
                println!("##[error]Process completed with exit code {code}.")
            }
            Outcome::Failure(None) => println!("##[error]The step did not complete."),
            _ => {}
        }
        outcomes.push(outcome);
    }
    outcomes
}

async fn run_one(
    n: usize,
    script: &str,
    shell: Option<&str>,
    bash: bool,
    dirs: &JobDirs,
    env: &[(String, String)],
) -> Outcome {
    let file = dirs.temp.join(format!("step-{n}.sh"));
    if let Err(e) = std::fs::write(&file, script) {
        println!(
            "##[error]imp-fake-runner: cannot write {}: {e}",
            file.display()
        );
        return Outcome::Failure(None);
    }
    let argv = match shell_argv(shell, bash, &file) {
        Ok(a) => a,
        Err(e) => {
            println!("##[error]{e}");
            return Outcome::Failure(None);
        }
    };
    let status = tokio::process::Command::new(&argv[0])
        .args(&argv[1..])
        .current_dir(&dirs.workspace)
        .env_remove(crate::JITCONFIG_ENV)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .status()
        .await;
    let _ = std::fs::remove_file(&file);
    match status {
        Ok(s) if s.success() => Outcome::Success,
        Ok(s) => Outcome::Failure(s.code()),
        Err(e) => {
            println!("##[error]imp-fake-runner: cannot start {}: {e}", argv[0]);
            Outcome::Failure(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_shell_is_bash_e_when_bash_exists_else_sh_e() {
        let f = Path::new("/w/_temp/step-1.sh");
        assert_eq!(
            shell_argv(None, true, f).unwrap(),
            ["bash", "-e", "/w/_temp/step-1.sh"]
        );
        assert_eq!(
            shell_argv(None, false, f).unwrap(),
            ["sh", "-e", "/w/_temp/step-1.sh"]
        );
        assert_eq!(
            shell_argv(Some("bash"), false, f).unwrap(),
            [
                "bash",
                "--noprofile",
                "--norc",
                "-eo",
                "pipefail",
                "/w/_temp/step-1.sh"
            ]
        );
        assert_eq!(shell_argv(Some("sh"), true, f).unwrap()[..2], ["sh", "-e"]);
        let e = shell_argv(Some("pwsh"), true, f).unwrap_err();
        assert!(e.contains("\"pwsh\""), "{e}");
    }

    #[test]
    fn a_failed_step_fails_the_job_and_skipped_steps_do_not() {
        use Outcome::*;
        assert_eq!(job_conclusion(&[]), "success");
        assert_eq!(job_conclusion(&[Success, Skipped]), "success");
        assert_eq!(
            job_conclusion(&[Success, Failure(Some(3)), Skipped]),
            "failure"
        );
        assert_eq!(Failure(None).conclusion(), "failure");
    }

    #[test]
    fn on_path_finds_executables_only() {
        let d = tempfile::tempdir().unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(d.path().join("x"), "").unwrap();
        std::fs::write(d.path().join("y"), "").unwrap();
        std::fs::set_permissions(d.path().join("x"), std::fs::Permissions::from_mode(0o755))
            .unwrap();
        let p = format!("/nonexistent:{}", d.path().display());
        assert!(on_path("x", &p));
        assert!(!on_path("y", &p));
        assert!(!on_path("z", &p));
    }

    #[tokio::test]
    async fn steps_run_in_order_in_the_workspace_and_stop_at_the_first_failure() {
        let d = tempfile::tempdir().unwrap();
        let dirs = JobDirs::create(&d.path().join("_work"), "acme/app").unwrap();
        assert!(dirs.workspace.is_absolute() && dirs.workspace.ends_with("_work/app/app"));
        let log = d.path().join("log");
        let step = |run: &str| Step {
            name: run.into(),
            run: Some(run.into()),
            uses: None,
            shell: None,
        };
        let steps = [
            step(&format!(
                "pwd >> {0}; echo \"$IMP_T\" >> {0}",
                log.display()
            )),
            Step {
                name: "checkout".into(),
                run: None,
                uses: Some("actions/checkout@v4".into()),
                shell: None,
            },
            // -e: the failing command ends the step; the echo after it never runs.
            step(&format!("false\necho after-false >> {}", log.display())),
            step(&format!("echo never >> {}", log.display())),
        ];
        let env = [("IMP_T".to_owned(), "from-env".to_owned())];
        let got = run_steps(&steps, &dirs, &env).await;
        use Outcome::*;
        assert_eq!(got, [Success, Skipped, Failure(Some(1)), Skipped]);
        let log = std::fs::read_to_string(log).unwrap();
        assert_eq!(
            log,
            format!(
                "{}\nfrom-env\n",
                dirs.workspace.canonicalize().unwrap().display()
            )
        );
        // Step scripts are removed.
        assert_eq!(std::fs::read_dir(&dirs.temp).unwrap().count(), 0);
    }
}
