//! Read-only ext4 base images from a flattened tree, with `mkfs.ext4 -d` (e2fsprogs): sized from
//! the content, written to a temp file beside the destination, fsynced, renamed into place only
//! when complete, so a crash never leaves a half-built image under the final name.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

const BLOCK: u64 = 4096;
const INODE_SIZE: u64 = 256;
const MIN_BYTES: u64 = 16 << 20;
/// A filesystem that does not fit is retried this many times, 1.5x larger each time.
const ATTEMPTS: u32 = 3;

#[derive(Debug, thiserror::Error)]
pub enum Ext4Error {
    #[error("measure {path}: {source}")]
    Walk {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("run mkfs.ext4 (Debian package e2fsprogs): {0}")]
    Spawn(std::io::Error),
    #[error("mkfs.ext4 -d {src} into {dest} ({bytes} bytes, {inodes} inodes): {stderr}")]
    Mkfs {
        src: PathBuf,
        dest: PathBuf,
        bytes: u64,
        inodes: u64,
        stderr: String,
    },
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What a tree needs on ext4: entries (inodes) and 4 KiB blocks of content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TreeUsage {
    pub entries: u64,
    pub data_blocks: u64,
}

/// Filesystem geometry for `mkfs.ext4`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsPlan {
    pub bytes: u64,
    pub inodes: u64,
}

/// Content plus metadata plus slack: inode tables (256 B per inode), ~3% for group descriptors,
/// bitmaps and directory growth, and a 16 MiB floor so tiny images still mount. Rounded to
/// whole MiB.
pub fn plan(usage: TreeUsage) -> FsPlan {
    // Slack inodes: lost+found, the guest's own runtime files, and rounding per group.
    let inodes = (usage.entries + usage.entries / 10 + 1024).max(2048);
    let data = usage.data_blocks * BLOCK;
    let meta = inodes * INODE_SIZE;
    let bytes = (data + meta + (data + meta) * 3 / 100 + (8 << 20)).max(MIN_BYTES);
    FsPlan {
        bytes: bytes.div_ceil(1 << 20) << 20,
        inodes,
    }
}

fn blocks(len: u64) -> u64 {
    len.div_ceil(BLOCK)
}

/// Walk `root` without following symlinks; hard links are counted once.
pub fn measure(root: &Path) -> Result<TreeUsage, Ext4Error> {
    let mut usage = TreeUsage::default();
    let mut seen = HashSet::new();
    let mut stack = vec![root.to_path_buf()];
    let walk = |path: &Path, source| Ext4Error::Walk {
        path: path.to_path_buf(),
        source,
    };
    while let Some(dir) = stack.pop() {
        usage.entries += 1;
        let mut names = 0u64;
        for entry in std::fs::read_dir(&dir).map_err(|e| walk(&dir, e))? {
            let entry = entry.map_err(|e| walk(&dir, e))?;
            let path = entry.path();
            let md = std::fs::symlink_metadata(&path).map_err(|e| walk(&path, e))?;
            names += entry.file_name().len() as u64 + 12;
            let ft = md.file_type();
            if ft.is_dir() {
                stack.push(path);
            } else if md.nlink() > 1 && !seen.insert((md.dev(), md.ino())) {
                // Another name for an inode already counted.
            } else {
                usage.entries += 1;
                // Symlinks up to 60 bytes live in the inode; longer ones take a block.
                if ft.is_file() || (ft.is_symlink() && md.len() > 60) {
                    usage.data_blocks += blocks(md.len());
                    // Extent tree blocks for large files.
                    usage.data_blocks += md.len() / (128 << 20);
                }
            }
        }
        usage.data_blocks += blocks(names).max(1);
    }
    Ok(usage)
}

/// What `build` made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Built {
    pub usage: TreeUsage,
    pub plan: FsPlan,
}

/// Build `dest` from the tree at `src`. Read-only use: no journal, no reserved blocks, inode
/// tables initialised now (the guest never writes the base, so lazy init would never finish).
pub fn build(src: &Path, dest: &Path) -> Result<Built, Ext4Error> {
    let usage = measure(src)?;
    let mut plan = plan(usage);
    let tmp = temp_path(dest);
    let io = |op, path: &Path, source| Ext4Error::Io {
        op,
        path: path.to_path_buf(),
        source,
    };
    let mut attempt = 1;
    loop {
        let file = std::fs::File::create(&tmp).map_err(|e| io("create", &tmp, e))?;
        file.set_len(plan.bytes).map_err(|e| io("size", &tmp, e))?;
        drop(file);
        let out = Command::new("mkfs.ext4")
            .args(["-q", "-F", "-b", "4096", "-m", "0", "-I", "256"])
            .args(["-O", "^has_journal,^resize_inode"])
            .args(["-E", "lazy_itable_init=0,root_owner=0:0"])
            .args(["-L", "imp-rootfs", "-N"])
            .arg(plan.inodes.to_string())
            .arg("-d")
            .arg(src)
            .arg(&tmp)
            .output()
            .map_err(Ext4Error::Spawn)?;
        if out.status.success() {
            break;
        }
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        let _ = std::fs::remove_file(&tmp);
        let full = stderr.contains("Could not allocate")
            || stderr.contains("No space left")
            || stderr.contains("too many inodes")
            || stderr.contains("inode");
        if !full || attempt == ATTEMPTS {
            return Err(Ext4Error::Mkfs {
                src: src.to_path_buf(),
                dest: dest.to_path_buf(),
                bytes: plan.bytes,
                inodes: plan.inodes,
                stderr,
            });
        }
        tracing::info!(
            bytes = plan.bytes,
            "ext4 image too small for its content; retrying larger"
        );
        plan.bytes = (plan.bytes * 3 / 2).div_ceil(1 << 20) << 20;
        plan.inodes = plan.inodes * 3 / 2;
        attempt += 1;
    }
    let file = std::fs::File::open(&tmp).map_err(|e| io("open", &tmp, e))?;
    file.sync_all().map_err(|e| io("fsync", &tmp, e))?;
    std::fs::rename(&tmp, dest).map_err(|e| io("rename", &tmp, e))?;
    sync_dir(dest).map_err(|e| io("fsync directory of", dest, e))?;
    Ok(Built { usage, plan })
}

/// `.<name>.tmp` beside `dest`, on the same filesystem so the rename is atomic.
fn temp_path(dest: &Path) -> PathBuf {
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    dest.with_file_name(format!(".{name}.tmp"))
}

/// Make a rename durable: fsync the directory holding `path`.
pub(crate) fn sync_dir(path: &Path) -> std::io::Result<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => std::fs::File::open(dir)?.sync_all(),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn plan_scales_with_content_and_has_a_floor() {
        let tiny = plan(TreeUsage {
            entries: 3,
            data_blocks: 2,
        });
        assert_eq!(tiny.bytes, MIN_BYTES);
        assert!(tiny.inodes >= 2048);
        let big = plan(TreeUsage {
            entries: 50_000,
            data_blocks: 500_000,
        });
        let content = 500_000 * BLOCK + 50_000 * INODE_SIZE;
        assert!(big.bytes > content, "{big:?}");
        assert!(big.bytes < content + content / 10 + (16 << 20), "{big:?}");
        assert_eq!(big.bytes % (1 << 20), 0);
        assert!(big.inodes > 50_000);
    }

    #[test]
    fn measure_counts_hardlinks_once_and_skips_short_symlinks() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("a"), vec![1u8; 10_000]).unwrap();
        std::fs::hard_link(d.path().join("a"), d.path().join("b")).unwrap();
        std::os::unix::fs::symlink("a", d.path().join("s")).unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        let u = measure(d.path()).unwrap();
        // root, sub, a (once), s
        assert_eq!(u.entries, 4);
        // a: 3 blocks; one directory block each for root and sub.
        assert_eq!(u.data_blocks, 3 + 2);
    }

    #[test]
    fn builds_an_image_that_e2fsck_accepts_and_holds_the_tree() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("tree");
        std::fs::create_dir_all(src.join("sbin")).unwrap();
        std::fs::write(src.join("sbin/tool"), b"#!/bin/sh\n").unwrap();
        std::fs::set_permissions(
            src.join("sbin/tool"),
            std::fs::Permissions::from_mode(0o4755),
        )
        .unwrap();
        // Many small files: inode-bound, not block-bound.
        std::fs::create_dir(src.join("many")).unwrap();
        for i in 0..3000 {
            std::fs::write(src.join("many").join(i.to_string()), b"x").unwrap();
        }
        let dest = d.path().join("base.ext4");
        let built = build(&src, &dest).unwrap();
        assert!(built.usage.entries > 3000);
        assert!(!temp_path(&dest).exists());
        assert_eq!(std::fs::metadata(&dest).unwrap().len(), built.plan.bytes);
        imp_testkit::ext4::assert_fsck_clean(&dest);
        let stat = Command::new("debugfs")
            .args(["-R", "stat /sbin/tool"])
            .arg(&dest)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&stat.stdout);
        assert!(text.contains("Mode:  04755"), "{text}");
    }

    #[test]
    fn a_missing_source_names_the_path() {
        let d = tempfile::tempdir().unwrap();
        let err = build(&d.path().join("nope"), &d.path().join("x.ext4")).unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
        assert!(!d.path().join("x.ext4").exists());
    }
}
