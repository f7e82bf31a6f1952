//! A real OCI registry on 127.0.0.1 for pull tests: the CNCF distribution registry (Debian's
//! `docker-registry`), filesystem storage in a temp dir, optional htpasswd basic auth, plain HTTP.
//! Stopped on drop, and by the process teardown in [`crate::process`] if the test dies.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::process::ManagedProcess;

const BINARY: &str = "docker-registry";
const DEBIAN_PACKAGE: &str = "docker-registry";
const READY_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug, Default, Clone)]
pub struct RegistryOptions {
    /// `(username, password)`: require HTTP basic auth against a bcrypt htpasswd file.
    pub htpasswd: Option<(String, String)>,
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error(
        "`{BINARY}` not found on PATH; install the Debian package `{DEBIAN_PACKAGE}` \
         (and `apache2-utils` for htpasswd)"
    )]
    BinaryMissing,
    #[error("`htpasswd` failed ({0}); install the Debian package `apache2-utils`")]
    Htpasswd(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "docker-registry did not answer GET /v2/ within {after:?}; last log lines:\n{log_tail}"
    )]
    NotReady { after: Duration, log_tail: String },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> RegistryError {
    let what = what.into();
    move |source| RegistryError::Io { what, source }
}

pub struct Registry {
    // Field order: the process stops before its storage directory is removed.
    process: ManagedProcess,
    port: u16,
    dir: tempfile::TempDir,
}

impl Registry {
    /// Starts a registry on a free port and waits until `GET /v2/` answers (200, or 401 when
    /// htpasswd auth is on).
    pub async fn start(opts: RegistryOptions) -> Result<Registry, RegistryError> {
        if !on_path(BINARY) {
            return Err(RegistryError::BinaryMissing);
        }
        let dir = tempfile::Builder::new()
            .prefix("imp-registry-")
            .tempdir()
            .map_err(io_err("create the registry temp dir"))?;
        let storage = dir.path().join("storage");
        std::fs::create_dir(&storage).map_err(io_err("create the registry storage dir"))?;

        let auth = match &opts.htpasswd {
            None => String::new(),
            Some((user, password)) => {
                let path = dir.path().join("htpasswd");
                std::fs::write(&path, htpasswd_line(user, password)?)
                    .map_err(io_err("write the htpasswd file"))?;
                format!(
                    "auth:\n  htpasswd:\n    realm: imp-test\n    path: {}\n",
                    path.display()
                )
            }
        };
        let port = free_port()?;
        let config = format!(
            "version: 0.1\n\
             log:\n  level: error\n  accesslog:\n    disabled: true\n\
             storage:\n  filesystem:\n    rootdirectory: {}\n  \
             maintenance:\n    uploadpurging:\n      enabled: false\n\
             http:\n  addr: 127.0.0.1:{port}\n{auth}",
            storage.display()
        );
        let config_path = dir.path().join("config.yml");
        std::fs::write(&config_path, config).map_err(io_err("write the registry config"))?;

        let mut cmd = Command::new(BINARY);
        cmd.arg("serve").arg(&config_path);
        let process = ManagedProcess::spawn("docker-registry", cmd, &dir.path().join("log"))
            .map_err(io_err("spawn docker-registry"))?;
        let mut registry = Registry { process, port, dir };
        registry.wait_ready().await?;
        Ok(registry)
    }

    /// `127.0.0.1:<port>`, as it appears in image references.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Where the registry stores the blob with `digest` (`sha256:<hex>`), so tests can tamper
    /// with what it serves.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").expect("a sha256 digest");
        self.storage_dir()
            .join("docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }

    pub fn storage_dir(&self) -> PathBuf {
        self.dir.path().join("storage")
    }

    pub fn log_tail(&self, lines: usize) -> String {
        self.process.log_tail(lines)
    }

    /// Stop serving (an outage); the storage stays until drop.
    pub fn stop(&mut self) {
        self.process.stop(Duration::from_secs(5));
    }

    async fn wait_ready(&mut self) -> Result<(), RegistryError> {
        let start = Instant::now();
        loop {
            if let Some(status) = v2_status(self.port).await
                && (status == 200 || status == 401)
            {
                return Ok(());
            }
            let exited = matches!(self.process.try_exit_status(), Ok(Some(_)));
            if exited || start.elapsed() > READY_TIMEOUT {
                return Err(RegistryError::NotReady {
                    after: start.elapsed(),
                    log_tail: self.process.log_tail(20),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The status code of `GET /v2/`, or `None` while nothing answers.
async fn v2_status(port: u16) -> Option<u16> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    stream
        .write_all(b"GET /v2/ HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .ok()?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).await.ok()?;
    // "HTTP/1.x NNN"
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// One bcrypt line from `htpasswd -Bbn`: distribution's htpasswd backend accepts only bcrypt.
fn htpasswd_line(user: &str, password: &str) -> Result<Vec<u8>, RegistryError> {
    let out = Command::new("htpasswd")
        .args(["-Bbn", user, password])
        .output()
        .map_err(|e| RegistryError::Htpasswd(e.to_string()))?;
    if !out.status.success() {
        return Err(RegistryError::Htpasswd(format!(
            "exit {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(out.stdout)
}

fn free_port() -> Result<u16, RegistryError> {
    let listener =
        std::net::TcpListener::bind("127.0.0.1:0").map_err(io_err("bind a free port"))?;
    Ok(listener
        .local_addr()
        .map_err(io_err("read a bound port"))?
        .port())
}

fn on_path(binary: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|paths| {
        std::env::split_paths(&paths).any(|dir| is_executable(&dir.join(binary)))
    })
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
