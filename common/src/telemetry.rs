//! How every Imp binary starts and stops: the same log flags (`--log` / `IMP_LOG`, `--log-format` /
//! `IMP_LOG_FORMAT`), logs on stderr with ANSI colour only when stderr is a terminal, and one
//! [`ShutdownSignal`] (SIGTERM, what Kubernetes sends, or SIGINT) that starts a graceful stop.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Log flags shared by the binaries; `#[command(flatten)]` them into the binary's `Args`.
#[derive(clap::Args, Debug, Clone, PartialEq, Eq)]
pub struct LogArgs {
    /// Log filter (tracing env-filter syntax, e.g. `info,imp_agent=debug`).
    #[arg(long = "log", env = "IMP_LOG", default_value = "info")]
    pub filter: String,
    /// Log line format.
    #[arg(long = "log-format", env = "IMP_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub format: LogFormat,
}

/// How log lines are written.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines (coloured on a terminal only).
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Why logging could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("--log / IMP_LOG {filter:?} is not a valid log filter: {source}")]
    InvalidFilter {
        filter: String,
        source: tracing_subscriber::filter::ParseError,
    },
    #[error("a global log subscriber is already installed")]
    AlreadyInstalled,
}

impl LogArgs {
    /// Installs the global subscriber: stderr, the filter, the format, ANSI only on a terminal.
    pub fn init(&self) -> Result<(), TelemetryError> {
        let filter =
            EnvFilter::try_new(&self.filter).map_err(|source| TelemetryError::InvalidFilter {
                filter: self.filter.clone(),
                source,
            })?;
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr);
        let installed = match self.format {
            LogFormat::Text => builder
                .with_ansi(std::io::stderr().is_terminal())
                .try_init(),
            LogFormat::Json => builder.with_ansi(false).json().try_init(),
        };
        installed.map_err(|_| TelemetryError::AlreadyInstalled)
    }
}

/// SIGTERM and SIGINT handlers. Install them first thing in `main` (a signal that arrives while the
/// binary is still starting is then kept, not fatal: tokio's handler replaces the default
/// action); [`recv`](Self::recv) resolves on the first of them, and the binary then stops serving,
/// lets its tasks end (or aborts them) and exits 0.
pub struct ShutdownSignal {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl ShutdownSignal {
    /// Installs both handlers; needs a running tokio runtime.
    pub fn install() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(ShutdownSignal {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// Waits for the first of them.
    pub async fn recv(mut self) {
        let name = tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        };
        tracing::info!(signal = name, "shutdown signal received; stopping");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        log: LogArgs,
    }

    fn parse(args: &[&str]) -> Result<LogArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("bin").chain(args.iter().copied())).map(|c| c.log)
    }

    // The env fallbacks (IMP_LOG, IMP_LOG_FORMAT) are not exercised here: setting process
    // environment races with other tests. The binaries' acceptance tests use them.
    #[test]
    fn flags_parse_and_default_to_info_text() {
        if std::env::var_os("IMP_LOG").is_none() && std::env::var_os("IMP_LOG_FORMAT").is_none() {
            assert_eq!(
                parse(&[]).unwrap(),
                LogArgs {
                    filter: "info".into(),
                    format: LogFormat::Text
                }
            );
        }
        let a = parse(&["--log", "debug,hyper=info", "--log-format", "json"]).unwrap();
        assert_eq!(a.filter, "debug,hyper=info");
        assert_eq!(a.format, LogFormat::Json);
    }

    #[test]
    fn an_unknown_format_is_rejected_naming_the_flag() {
        let err = parse(&["--log-format", "yaml"]).unwrap_err().to_string();
        assert!(
            err.contains("--log-format") && err.contains("yaml"),
            "{err}"
        );
        assert!(err.contains("text") && err.contains("json"), "{err}");
    }

    #[test]
    fn a_bad_filter_is_an_error_naming_the_flag_and_env() {
        let a = LogArgs {
            filter: "imp=[".into(),
            format: LogFormat::Text,
        };
        let err = a.init().unwrap_err().to_string();
        assert!(
            err.contains("--log / IMP_LOG") && err.contains("imp=["),
            "{err}"
        );
    }

    #[tokio::test]
    async fn sigterm_resolves_the_shutdown_signal() {
        let signal = ShutdownSignal::install().unwrap();
        // The handler is installed (and tokio keeps it for the process), so this does not kill
        // the test process.
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &std::process::id().to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill -TERM failed");
        tokio::time::timeout(std::time::Duration::from_secs(10), signal.recv())
            .await
            .expect("SIGTERM observed");
    }
}
