//! Writes the CRD manifests generated from the Rust types (default: helm/imp/crds/).

use std::{fs, path::PathBuf, process::ExitCode};

use clap::Parser;

#[derive(Parser)]
#[command(about = "Generate Imp's CustomResourceDefinitions from the Rust types")]
struct Args {
    /// Directory to write <plural>.imp.dev.yaml files into.
    #[arg(long, default_value = "helm/imp/crds")]
    out_dir: PathBuf,
    /// Print all CRDs to stdout as one multi-document YAML instead of writing files.
    #[arg(long)]
    stdout: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mut docs = Vec::new();
    for (file, crd) in imp_api::crds() {
        let yaml = match imp_api::crd_yaml(&crd) {
            Ok(y) => y,
            Err(e) => {
                eprintln!("crdgen: cannot render {file}: {e}");
                return ExitCode::FAILURE;
            }
        };
        if args.stdout {
            docs.push(yaml);
            continue;
        }
        let path = args.out_dir.join(file);
        if let Err(e) = fs::create_dir_all(&args.out_dir).and_then(|_| fs::write(&path, yaml)) {
            eprintln!("crdgen: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        eprintln!("crdgen: wrote {}", path.display());
    }
    if args.stdout {
        print!("{}", docs.join("---\n"));
    }
    ExitCode::SUCCESS
}
