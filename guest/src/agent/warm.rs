//! `Warm`: read files into the page cache before a template's snapshot (docs/snapshots.md,
//! "Warming"), so its clones' runners find them in memory.
//!
//! The pure half ([`plan`]: checks and normalises the request, [`Budget`]: the bounds) is tested
//! here; [`run`] walks and reads, tested here on temporary trees and through the agent in
//! guest/tests/agent.rs.

use std::io::Read as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Component, Path, PathBuf};
use std::time::Instant;

use crate::protocol::{WARM_MAX_FILES, WARM_MAX_PATHS, Warm, Warmed, check_warm_path};

/// A field of a `Warm` the guest refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("warm: {field}: {reason}")]
pub struct InvalidField {
    pub field: &'static str,
    pub reason: String,
}

fn invalid(field: &'static str, reason: impl Into<String>) -> InvalidField {
    InvalidField {
        field,
        reason: reason.into(),
    }
}

/// A checked `Warm`: the roots to walk (normalised, none inside another, in the request's
/// order) and the bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub roots: Vec<PathBuf>,
    pub max_bytes: u64,
    pub max_files: u64,
}

/// Check and normalise `req`. A root inside another root is dropped (its files would be read,
/// and counted, twice).
pub fn plan(req: &Warm) -> Result<Plan, InvalidField> {
    if req.paths.is_empty() || req.paths.len() > WARM_MAX_PATHS {
        return Err(invalid("paths", format!("1-{WARM_MAX_PATHS} paths")));
    }
    let mut roots: Vec<PathBuf> = Vec::new();
    for (i, p) in req.paths.iter().enumerate() {
        check_warm_path(p).map_err(|why| invalid("paths", format!("[{i}]: {why}")))?;
        // Lexical: `.` and repeated or trailing slashes go; `..` was refused above.
        let norm: PathBuf = Path::new(p)
            .components()
            .filter(|c| !matches!(c, Component::CurDir))
            .collect();
        if roots.iter().any(|r| norm.starts_with(r)) {
            continue;
        }
        roots.retain(|r| !r.starts_with(&norm));
        roots.push(norm);
    }
    if req.max_bytes == 0 {
        return Err(invalid("max_bytes", "must be positive"));
    }
    if req.max_files == 0 || req.max_files > WARM_MAX_FILES {
        return Err(invalid("max_files", format!("1-{WARM_MAX_FILES}")));
    }
    Ok(Plan {
        roots,
        max_bytes: req.max_bytes,
        max_files: req.max_files,
    })
}

/// What is left of a plan's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub bytes: u64,
    pub files: u64,
}

impl Budget {
    /// Bytes to read of a file of `size` bytes: all of it, or what the budget has left.
    pub fn take(&self, size: u64) -> u64 {
        size.min(self.bytes)
    }
}

/// Read buffer: large reads, few syscalls.
const CHUNK: usize = 1 << 20;

/// Walk the plan's roots depth first in name order (a truncated walk reads the same files each
/// time), reading every regular file to its end or to the byte bound. Never follows a symlink,
/// never enters a directory of another filesystem than its root's (no /proc or /sys under a
/// `/`). Blocking.
pub fn run(plan: &Plan) -> Warmed {
    let started = Instant::now();
    let mut left = Budget {
        bytes: plan.max_bytes,
        files: plan.max_files,
    };
    let mut out = Warmed {
        files: 0,
        bytes: 0,
        millis: 0,
        truncated: false,
        skipped: 0,
    };
    let mut buf = vec![0u8; CHUNK];
    'roots: for root in &plan.roots {
        let Ok(meta) = std::fs::symlink_metadata(root) else {
            out.skipped += 1;
            continue;
        };
        let dev = meta.dev();
        // Reversed on the stack so names come off in order.
        let mut stack = vec![(root.clone(), meta)];
        while let Some((path, meta)) = stack.pop() {
            let ft = meta.file_type();
            // Directories only: overlayfs reports its lower layers' device for files.
            if (ft.is_dir() && meta.dev() != dev) || !(ft.is_dir() || ft.is_file()) {
                out.skipped += 1;
            } else if ft.is_file() {
                if left.files == 0 {
                    out.truncated = true;
                    break 'roots;
                }
                let want = left.take(meta.len());
                match read_file(&path, want, &mut buf) {
                    Ok(n) => {
                        out.files += 1;
                        out.bytes += n;
                        left.files -= 1;
                        left.bytes -= n;
                        if want < meta.len() {
                            out.truncated = true;
                            break 'roots;
                        }
                    }
                    Err(_) => out.skipped += 1,
                }
            } else {
                let Ok(rd) = std::fs::read_dir(&path) else {
                    out.skipped += 1;
                    continue;
                };
                let mut children: Vec<_> = rd
                    .flatten()
                    .filter_map(|e| e.metadata().ok().map(|m| (e.path(), m)))
                    .collect();
                children.sort_by(|a, b| b.0.cmp(&a.0));
                stack.extend(children);
            }
        }
    }
    out.millis = started.elapsed().as_millis() as u64;
    out
}

/// Read up to `limit` bytes of `path`; the bytes read.
fn read_file(path: &Path, limit: u64, buf: &mut [u8]) -> std::io::Result<u64> {
    use std::os::unix::fs::OpenOptionsExt as _;
    // O_NOFOLLOW: a file swapped for a symlink since it was listed is not followed.
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    let mut total = 0u64;
    while total < limit {
        let want = (limit - total).min(buf.len() as u64) as usize;
        match f.read(&mut buf[..want]) {
            Ok(0) => break,
            Ok(n) => total += n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::WARM_DEFAULT_FILES;

    fn req(paths: &[&str]) -> Warm {
        Warm {
            paths: paths.iter().map(|p| p.to_string()).collect(),
            max_bytes: 1 << 20,
            max_files: WARM_DEFAULT_FILES,
        }
    }

    #[test]
    fn every_bad_field_is_named() {
        type Edit = fn(&mut Warm);
        let cases: Vec<(&str, Edit)> = vec![
            ("paths", |w| w.paths.clear()),
            ("paths", |w| w.paths = vec!["/a".into(); WARM_MAX_PATHS + 1]),
            ("paths", |w| w.paths = vec!["/ok".into(), "relative".into()]),
            ("paths", |w| w.paths = vec!["/opt/../etc".into()]),
            ("paths", |w| w.paths = vec![String::new()]),
            ("max_bytes", |w| w.max_bytes = 0),
            ("max_files", |w| w.max_files = 0),
            ("max_files", |w| w.max_files = WARM_MAX_FILES + 1),
        ];
        for (field, edit) in cases {
            let mut w = req(&["/opt/actions-runner"]);
            edit(&mut w);
            let e = plan(&w).unwrap_err();
            assert_eq!(e.field, field, "{e}");
            assert!(
                e.to_string().starts_with(&format!("warm: {field}: ")),
                "{e}"
            );
        }
        let e = plan(&req(&["/ok", "relative"])).unwrap_err();
        assert!(e.reason.starts_with("[1]: "), "{e}");
    }

    #[test]
    fn roots_are_normalised_and_nested_ones_dropped() {
        let p = plan(&req(&[
            "/opt/actions-runner/bin/",
            "/usr/local/bin/imp-runner",
            "/opt//./actions-runner",
            "/opt/actions-runner",
        ]))
        .unwrap();
        let roots: Vec<&str> = p.roots.iter().map(|r| r.to_str().unwrap()).collect();
        assert_eq!(roots, ["/usr/local/bin/imp-runner", "/opt/actions-runner"]);
    }

    #[test]
    fn the_budget_bounds_bytes_and_files() {
        let b = Budget {
            bytes: 10,
            files: 2,
        };
        assert_eq!((b.take(4), b.take(40), b.take(0)), (4, 10, 0));
    }

    fn tree() -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let root = d.path().join("runner");
        std::fs::create_dir_all(root.join("bin/sub")).unwrap();
        std::fs::write(root.join("a"), vec![1u8; 3000]).unwrap();
        std::fs::write(root.join("bin/b"), vec![2u8; 5000]).unwrap();
        std::fs::write(root.join("bin/sub/c"), vec![3u8; 7]).unwrap();
        std::fs::write(root.join("empty"), b"").unwrap();
        // Out of the tree: never read through the link.
        std::fs::write(d.path().join("outside"), vec![9u8; 100_000]).unwrap();
        std::os::unix::fs::symlink(d.path().join("outside"), root.join("link")).unwrap();
        nix::unistd::mkfifo(&root.join("fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        (d, root)
    }

    fn plan_of(root: &Path, max_bytes: u64, max_files: u64) -> Plan {
        Plan {
            roots: vec![root.to_path_buf()],
            max_bytes,
            max_files,
        }
    }

    #[test]
    fn a_tree_is_read_without_following_links_or_special_files() {
        let (_d, root) = tree();
        let w = run(&plan_of(&root, 1 << 30, 100));
        assert_eq!((w.files, w.bytes, w.truncated), (4, 8007, false), "{w:?}");
        assert_eq!(w.skipped, 2, "the symlink and the fifo: {w:?}");
        // A single file as a root, and a root that does not exist.
        let mut p = plan_of(&root.join("bin/b"), 1 << 30, 100);
        p.roots.push(root.join("missing"));
        let w = run(&p);
        assert_eq!((w.files, w.bytes, w.skipped), (1, 5000, 1), "{w:?}");
    }

    #[test]
    fn bounds_truncate_in_name_order() {
        let (_d, root) = tree();
        // Name order: a (3000), bin/b (5000), bin/sub/c, empty.
        let w = run(&plan_of(&root, 4000, 100));
        assert_eq!((w.files, w.bytes, w.truncated), (2, 4000, true), "{w:?}");
        let w = run(&plan_of(&root, 1 << 30, 1));
        assert_eq!((w.files, w.bytes, w.truncated), (1, 3000, true), "{w:?}");
        // Bounds met exactly truncate nothing (an empty file still fits no bytes).
        let w = run(&plan_of(&root, 8007, 100));
        assert_eq!((w.files, w.bytes, w.truncated), (4, 8007, false), "{w:?}");
    }
}
