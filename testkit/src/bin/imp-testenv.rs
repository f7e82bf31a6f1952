//! Runs the test control plane in the foreground for local use (smoke runs, debugging):
//! `imp-testenv up --dir D` writes D/kubeconfig, prints `KUBECONFIG=...`, and stops everything it
//! started on SIGINT/SIGTERM. `imp-testenv check` says whether the testenv binaries are built.

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};
use imp_testkit::{
    controlplane::{ControlPlane, ControlPlaneOptions},
    paths,
};

#[derive(Parser)]
#[command(
    about = "Imp's test control plane: etcd + kube-apiserver + kube-controller-manager on 127.0.0.1"
)]
struct Args {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start the control plane and keep it running until interrupted.
    Up {
        /// Work directory (kubeconfig, certs, logs); kept after exit.
        #[arg(long)]
        dir: PathBuf,
        /// Skip installing Imp's CRDs.
        #[arg(long)]
        no_crds: bool,
    },
    /// Check that every testenv binary is present.
    Check,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    match Args::parse().command {
        Cmd::Check => {
            let mut ok = true;
            for name in [
                "etcd",
                "kube-apiserver",
                "kube-controller-manager",
                "kubectl",
                "helm",
            ] {
                let path = paths::testenv_bin(name);
                if path.is_file() {
                    println!("ok      {}", path.display());
                } else {
                    println!("missing {} (run `make testenv`)", path.display());
                    ok = false;
                }
            }
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Cmd::Up { dir, no_crds } => {
            let opts = ControlPlaneOptions {
                dir,
                cleanup: false,
                controller_manager: true,
                install_imp_crds: !no_crds,
                bin_dir: paths::testenv_bin_dir(),
                ..ControlPlaneOptions::in_temp_dir()
            };
            let cp = match ControlPlane::start(opts).await {
                Ok(cp) => cp,
                Err(e) => {
                    eprintln!("imp-testenv: {e}");
                    return ExitCode::FAILURE;
                }
            };
            println!("KUBECONFIG={}", cp.kubeconfig_path().display());
            eprintln!(
                "imp-testenv: API server at {}; logs in {}; Ctrl-C stops it",
                cp.server(),
                cp.dir().display()
            );
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {},
                _ = term.recv() => {},
            }
            drop(cp);
            ExitCode::SUCCESS
        }
    }
}
