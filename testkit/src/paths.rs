//! Where the workspace keeps things tests need: testenv binaries, the chart, reference files.

use std::path::PathBuf;

/// Root of the Imp workspace (the directory holding the top Cargo.toml).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit lives one level below the workspace root")
        .to_path_buf()
}

/// Directory with etcd, kube-apiserver, kube-controller-manager, kubectl and helm.
/// `IMP_TESTENV_BIN` overrides the default `testenv/bin`.
pub fn testenv_bin_dir() -> PathBuf {
    std::env::var_os("IMP_TESTENV_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("testenv/bin"))
}

/// Path of one testenv binary.
pub fn testenv_bin(name: &str) -> PathBuf {
    testenv_bin_dir().join(name)
}

/// The repository's `reference/` directory: third-party specs and the design documents' seed examples,
/// kept byte-identical to their origin (`reference/README.md` names each source and licence).
pub fn reference_dir() -> PathBuf {
    workspace_root().join("reference")
}

/// The Helm chart.
pub fn chart_dir() -> PathBuf {
    workspace_root().join("helm/imp")
}
