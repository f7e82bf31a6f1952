//! `kubectl-imp`: copy it onto PATH and run `kubectl imp ...` (kubectl finds plugins by name).

use clap::Parser;
use kubectl_imp::cli::{Cli, run};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(out) => print!("{out}"),
        Err(e) => {
            eprintln!("kubectl imp: {e}");
            std::process::exit(e.exit_code());
        }
    }
}
