//! Shared helpers: run the real imp-guest binary in host-process mode on a temp Unix socket.
#![allow(dead_code)] // each test binary uses a different subset

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use imp_common::SecretString;
use imp_guest::host::{self, HostClient};
use imp_guest::protocol::{Exec, Exited, GuestToHost};
use tokio::time::Instant;

pub struct AgentProc {
    pub child: Option<Child>,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub log: PathBuf,
}

impl AgentProc {
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_wrapped(&[], extra)
    }

    /// Start the agent through `wrapper` (e.g. `ip netns exec NS unshare --uts`), which must
    /// exec it in place, so the child's pid is the agent's.
    pub fn start_wrapped(wrapper: &[&str], extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let log = dir.path().join("agent.log");
        let log_file = std::fs::File::create(&log).unwrap();
        let bin = env!("CARGO_BIN_EXE_imp-guest");
        let mut cmd = match wrapper.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        let child = cmd
            .arg("agent")
            .arg("--listen-unix")
            .arg(&socket)
            .args(extra)
            // Most verbose level: the secrets test must see everything the agent could log.
            .env("RUST_LOG", "trace")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file)
            .spawn()
            .unwrap();
        Self {
            child: Some(child),
            dir,
            socket,
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    pub async fn connect(&self) -> HostClient {
        host::connect_unix(&self.socket, Instant::now() + Duration::from_secs(10))
            .await
            .unwrap()
    }

    /// Wait up to `timeout` for the agent to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + timeout;
        let child = self.child.as_mut().unwrap();
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return Some(status);
            }
            if std::time::Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, wait, and return everything the agent wrote to stdout/stderr.
    pub fn stop(&mut self) -> String {
        if let Some(child) = self.child.as_mut() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::SIGTERM,
            );
            if self.wait_exit(Duration::from_secs(10)).is_none() {
                let _ = self.child.as_mut().unwrap().kill();
                let _ = self.child.as_mut().unwrap().wait();
            }
        }
        self.child = None;
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.stop();
        }
    }
}

pub fn exec(id: &str, argv: &[&str]) -> Exec {
    Exec {
        id: id.to_owned(),
        argv: argv.iter().map(|s| s.to_string()).collect(),
        env: BTreeMap::from([("PATH".to_owned(), SecretString::from("/usr/bin:/bin"))]),
        cwd: None,
        uid: None,
        gid: None,
        refuse_root: false,
        timeout_s: None,
        stream_output: false,
        poweroff_on_exit: false,
    }
}

pub fn sh(id: &str, script: &str) -> Exec {
    exec(id, &["/bin/sh", "-c", script])
}

/// Run to completion, collecting streamed stdout/stderr.
pub async fn run(client: &mut HostClient, mut req: Exec) -> (Vec<u8>, Vec<u8>, Exited) {
    use base64::Engine;
    req.stream_output = true;
    let id = req.id.clone();
    client.exec(req).await.unwrap();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    loop {
        match tokio::time::timeout(Duration::from_secs(30), client.recv())
            .await
            .unwrap()
            .unwrap()
        {
            GuestToHost::Output(o) if o.id == id => {
                let data = base64::engine::general_purpose::STANDARD
                    .decode(&o.data_b64)
                    .unwrap();
                match o.stream {
                    imp_guest::protocol::OutputStream::Stdout => out.extend(data),
                    imp_guest::protocol::OutputStream::Stderr => err.extend(data),
                }
            }
            GuestToHost::Exited(e) if e.id == id => return (out, err, e),
            _ => {}
        }
    }
}

pub fn is_root() -> bool {
    nix::unistd::Uid::effective().is_root()
}

/// Children of `pid` that are zombies.
pub fn zombie_children(pid: u32) -> Vec<u32> {
    let mut zombies = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) =
            std::fs::read_to_string(Path::new("/proc").join(child.to_string()).join("stat"))
        else {
            continue;
        };
        // comm may contain spaces; fields after the last ')' are fixed.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.len() > 1 && fields[0] == "Z" && fields[1] == pid.to_string() {
            zombies.push(child);
        }
    }
    zombies
}
