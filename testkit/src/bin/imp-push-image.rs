//! Push a small linux/amd64 OCI image (one gzip layer of the given files) to a plain-HTTP
//! registry and print its reference. Used by `smoke/imp-smoke.sh --local` to give imp-runtime's
//! rootfs cache something real to pull.
//!
//!     imp-push-image 127.0.0.1:5000 imp/runner-base:smoke etc/imp-smoke=hello opt/x=y

use std::process::ExitCode;

use clap::Parser;
use imp_testkit::oci::{LayerBlob, PushAuth, push_image};

#[derive(Parser)]
#[command(
    name = "imp-push-image",
    about = "Push a one-layer test image to a registry"
)]
struct Args {
    /// Registry `host:port` (plain HTTP).
    host: String,
    /// `repository:tag`.
    repo_tag: String,
    /// Files as `path=content`.
    #[arg(value_parser = file_spec)]
    files: Vec<(String, String)>,
}

fn file_spec(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(p, c)| (p.to_owned(), c.to_owned()))
        .ok_or_else(|| format!("{s:?} is not path=content"))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    let files: Vec<(&str, &[u8])> = args
        .files
        .iter()
        .map(|(p, c)| (p.as_str(), c.as_bytes()))
        .collect();
    let layer = LayerBlob::tar_gzip(&files);
    match push_image(&args.host, &args.repo_tag, &[layer], &PushAuth::Anonymous).await {
        Ok(_) => {
            println!("{}/{}", args.host, args.repo_tag);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!(
                "imp-push-image: push {} to {}: {e}",
                args.repo_tag, args.host
            );
            ExitCode::FAILURE
        }
    }
}
