//! `kubectl imp console VM [-f]`: the guest's serial log, read through `exec` in the imp-runtime pod
//! on the VM's node (the API server proxies it; no new network endpoint), where imp-runtime keeps it
//! as `<state dir>/vms/<uid>/serial.log` with its older half in `serial.log.1` (docs/runtime.md).
//! Every line passes [`Redactor`] before it is shown: a JIT config, a token or a private key printed
//! by a guest never reaches the terminal.

use imp_api::ImpVM;
use k8s_openapi::api::core::v1::Pod;
use kube::api::AttachParams;
use kube::{Api, Client};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::Error;

/// The runtime container of the chart's imp-runtime DaemonSet.
pub const RUNTIME_CONTAINER: &str = "runtime";
/// imp-runtime's `--state-dir` default.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/imp";
const REDACTED: &str = "[redacted]";
/// A base64 run this long is a credential blob (a JIT config is over a kilobyte), not log text.
const LONG_BASE64: usize = 100;

/// Where the console is read: the pod, and the command run in its runtime container.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub namespace: String,
    pub pod: String,
    pub node: String,
    pub command: Vec<String>,
}

/// The runtime pod on `vm`'s node and the command that prints (or with `follow`, follows) its log.
pub fn target(
    vm: &ImpVM,
    pods: &[Pod],
    imp_namespace: &str,
    follow: bool,
) -> Result<Target, Error> {
    let name = vm.metadata.name.clone().unwrap_or_default();
    let node = vm
        .spec
        .node_name
        .clone()
        .ok_or(Error::NotScheduled { vm: name })?;
    let pod = pods
        .iter()
        .find(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&node))
        .ok_or_else(|| Error::NoRuntimePod {
            node: node.clone(),
            namespace: imp_namespace.to_owned(),
        })?;
    let state_dir = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.iter().find(|c| c.name == RUNTIME_CONTAINER))
        .and_then(|c| c.env.as_ref())
        .and_then(|env| env.iter().find(|e| e.name == "IMP_STATE_DIR"))
        .and_then(|e| e.value.clone())
        .unwrap_or_else(|| DEFAULT_STATE_DIR.to_owned());
    let dir = format!(
        "{state_dir}/vms/{}",
        vm.metadata.uid.clone().unwrap_or_default()
    );
    // The runtime image has a static busybox and nothing else to read files with.
    let script = if follow {
        r#"[ -f "$0/serial.log.1" ] && /bin/busybox cat "$0/serial.log.1"; exec /bin/busybox tail -n +1 -F "$0/serial.log""#
    } else {
        r#"[ -d "$0" ] || { echo "no console log: $0 does not exist" >&2; exit 3; }; for f in "$0/serial.log.1" "$0/serial.log"; do [ -f "$f" ] && /bin/busybox cat "$f"; done; exit 0"#
    };
    Ok(Target {
        namespace: imp_namespace.to_owned(),
        pod: pod.metadata.name.clone().unwrap_or_default(),
        node,
        command: ["/bin/busybox", "sh", "-c", script, &dir]
            .map(str::to_owned)
            .to_vec(),
    })
}

/// Removes secrets from console lines: a private key block, GitHub tokens, the value of anything
/// named like a JIT config, and long base64 runs (how a JIT config looks on its own).
#[derive(Debug, Default)]
pub struct Redactor {
    in_key: bool,
}

fn is_b64(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '+' | '/' | '=' | '-' | '_')
}

impl Redactor {
    pub fn line(&mut self, line: &str) -> String {
        if self.in_key {
            if line.contains("-----END") {
                self.in_key = false;
            }
            return REDACTED.to_owned();
        }
        if line.contains("-----BEGIN") && line.contains("PRIVATE KEY") {
            self.in_key = !line.contains("-----END");
            return REDACTED.to_owned();
        }
        let lower = line.to_ascii_lowercase();
        if let Some(i) = lower.find("jitconfig").or_else(|| lower.find("jit_config")) {
            // Keep the name, drop whatever follows it.
            let keep = i + line[i..]
                .find(['=', ':', ' '])
                .map_or(line.len() - i, |j| j + 1);
            return format!("{}{REDACTED}", &line[..keep]);
        }
        let mut out = String::with_capacity(line.len());
        let mut rest = line;
        while !rest.is_empty() {
            let start = rest.find(is_b64).unwrap_or(rest.len());
            out.push_str(&rest[..start]);
            rest = &rest[start..];
            let end = rest.find(|c: char| !is_b64(c)).unwrap_or(rest.len());
            let word = &rest[..end];
            let token = ["ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"]
                .iter()
                .any(|p| word.starts_with(p) && word.len() >= p.len() + 20);
            out.push_str(if token || word.len() >= LONG_BASE64 {
                REDACTED
            } else {
                word
            });
            rest = &rest[end..];
        }
        out
    }
}

/// Streams the console of `target` to stdout, redacted; returns when the log ends (or, following,
/// when the command is interrupted).
pub async fn stream(client: &Client, target: &Target) -> Result<(), Error> {
    let exec_err = |message: String| Error::Exec {
        pod: format!("{}/{}", target.namespace, target.pod),
        message,
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), &target.namespace);
    let params = AttachParams::default()
        .container(RUNTIME_CONTAINER)
        .stdin(false)
        .stdout(true)
        .stderr(true);
    let mut process = pods
        .exec(&target.pod, target.command.clone(), &params)
        .await
        .map_err(|e| exec_err(e.to_string()))?;
    let stdout = process
        .stdout()
        .ok_or_else(|| exec_err("no stdout".to_owned()))?;
    let stderr = process.stderr();
    let status = process.take_status();
    let mut lines = BufReader::new(stdout).lines();
    let mut redactor = Redactor::default();
    let mut out = tokio::io::stdout();
    while let Some(line) = lines
        .next_line()
        .await
        .map_err(|e| exec_err(e.to_string()))?
    {
        let shown = redactor.line(&line) + "\n";
        out.write_all(shown.as_bytes())
            .await
            .map_err(|e| exec_err(e.to_string()))?;
    }
    out.flush().await.map_err(|e| exec_err(e.to_string()))?;
    let mut err_text = String::new();
    if let Some(stderr) = stderr {
        let mut err_lines = BufReader::new(stderr).lines();
        while let Ok(Some(l)) = err_lines.next_line().await {
            err_text.push_str(&Redactor::default().line(&l));
        }
    }
    if let Some(status) = status
        && let Some(s) = status.await
        && s.status.as_deref() == Some("Failure")
    {
        return Err(exec_err(if err_text.is_empty() {
            s.message.unwrap_or_default()
        } else {
            err_text
        }));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jit_config_never_passes() {
        let jit = "eyJ".to_owned() + &"QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo".repeat(8);
        let mut r = Redactor::default();
        assert_eq!(r.line(&format!("runner: {jit}")), "runner: [redacted]");
        assert_eq!(
            r.line(&format!("ACTIONS_RUNNER_INPUT_JITCONFIG={jit}")),
            "ACTIONS_RUNNER_INPUT_JITCONFIG=[redacted]"
        );
        assert_eq!(r.line("--jitconfig abc"), "--jitconfig [redacted]");
    }

    #[test]
    fn tokens_and_key_blocks_go_ordinary_lines_stay() {
        let mut r = Redactor::default();
        let token = format!("token ghs_{} ok", "a".repeat(36));
        assert_eq!(r.line(&token), "token [redacted] ok");
        assert_eq!(r.line("-----BEGIN RSA PRIVATE KEY-----"), "[redacted]");
        assert_eq!(r.line("MIIEowIBAAKCAQEA"), "[redacted]");
        assert_eq!(r.line("-----END RSA PRIVATE KEY-----"), "[redacted]");
        let ordinary = "[    1.234] Run /init as init process, sha256:0123456789abcdef";
        assert_eq!(r.line(ordinary), ordinary);
    }
}
