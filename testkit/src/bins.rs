//! Workspace binaries that tests run as separate processes (simulators, the fake runner, the guest
//! agent): found beside the running test binary and rebuilt with cargo only when older than their
//! sources, so `cargo test --workspace`, which has built them already, never re-invokes cargo.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::SystemTime,
};

/// `<target>/<profile>` of the running test or bench binary (which lives in `<profile>/deps`).
pub fn profile_dir() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("locating the test binary: {e}"))?;
    exe.parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .ok_or_else(|| format!("{} is not in <target>/<profile>/deps", exe.display()))
}

/// Newest modification time of a file or of anything below a directory.
pub fn newest_mtime(path: &Path) -> Option<SystemTime> {
    let meta = std::fs::metadata(path).ok()?;
    let own = meta.modified().ok();
    if !meta.is_dir() {
        return own;
    }
    std::fs::read_dir(path)
        .ok()?
        .flatten()
        .filter_map(|e| newest_mtime(&e.path()))
        .chain(own)
        .max()
}

/// Paths of `bins` (`(package, binary)`) in the profile dir, built in one cargo call unless every
/// one is newer than `sources` (paths relative to the workspace root).
pub fn ensure_built(bins: &[(&str, &str)], sources: &[&str]) -> Result<Vec<PathBuf>, String> {
    let profile_dir = profile_dir()?;
    let paths: Vec<PathBuf> = bins.iter().map(|(_, bin)| profile_dir.join(bin)).collect();
    let root = crate::paths::workspace_root();
    let newest_source = sources
        .iter()
        .filter_map(|p| newest_mtime(&root.join(p)))
        .max();
    let fresh = |p: &PathBuf| {
        std::fs::metadata(p)
            .and_then(|m| m.modified())
            .is_ok_and(|t| Some(t) >= newest_source)
    };
    if paths.iter().all(fresh) {
        return Ok(paths);
    }
    let target_dir = profile_dir
        .parent()
        .ok_or("no target dir above the profile dir")?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&root)
        .args(["build", "-q"])
        .env("CARGO_TARGET_DIR", target_dir);
    for (package, bin) in bins {
        cmd.args(["-p", package, "--bin", bin]);
    }
    if let Some(profile) = profile_dir.file_name().and_then(|n| n.to_str()) {
        // "debug" is the dev profile's directory.
        cmd.args([
            "--profile",
            if profile == "debug" { "dev" } else { profile },
        ]);
    }
    let status = cmd.status().map_err(|e| format!("running cargo: {e}"))?;
    if !status.success() {
        let names: Vec<&str> = bins.iter().map(|(_, b)| *b).collect();
        return Err(format!("cargo build of {names:?} failed: {status}"));
    }
    Ok(paths)
}
