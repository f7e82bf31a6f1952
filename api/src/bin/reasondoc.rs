//! Writes docs/reasons.md from `imp_api::names::reason::ALL` (api/tests/reasons.rs checks it is current).

use std::{fs, path::PathBuf, process::ExitCode};

use clap::Parser;

#[derive(Parser)]
#[command(about = "Generate docs/reasons.md from the reason constants")]
struct Args {
    /// File to write.
    #[arg(long, default_value = "docs/reasons.md")]
    out: PathBuf,
    /// Print to stdout instead of writing the file.
    #[arg(long)]
    stdout: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let md = imp_api::names::reason::markdown();
    if args.stdout {
        print!("{md}");
        return ExitCode::SUCCESS;
    }
    if let Err(e) = fs::write(&args.out, md) {
        eprintln!("reasondoc: cannot write {}: {e}", args.out.display());
        return ExitCode::FAILURE;
    }
    eprintln!("reasondoc: wrote {}", args.out.display());
    ExitCode::SUCCESS
}
