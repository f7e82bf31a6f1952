//! Apply OCI image layers, in order, to a work directory (ARCHITECTURE §6).
//!
//! A layer is untrusted input unpacked by a root process, so safety comes from the kernel rather
//! than from string checks. The work directory is opened once; every parent directory is resolved
//! from that fd with `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`, which fails (EXDEV) when
//! `..` or a symlink would leave the root, at resolution time and without a check-then-use race.
//! The last component is then made relative to the parent fd by calls that never follow a
//! symlink there (mkdirat, openat `O_CREAT|O_EXCL|O_NOFOLLOW`, symlinkat, linkat without
//! `AT_SYMLINK_FOLLOW`, mknodat), and removal walks directories by fd, never following symlinks.
//! The name checks (no absolute names, no `..`) and the symlink walk after a refusal only make
//! the error precise. A refusal mid-layer leaves the work dir partly written; the caller deletes
//! it. Nothing is written outside it.
//!
//! Policy beyond path safety: symlinks may point anywhere (they are interpreted inside the guest)
//! but a write *through* an absolute symlink is refused, since the host cannot follow it without
//! reinterpreting it; hardlinks must name an existing path inside the tree; only the harmless
//! character devices in [`ALLOWED_CHAR_DEVICES`] and FIFOs are made; sizes are counted on the
//! decompressed stream, so lying headers and compression bombs stop at the limit.
//!
//! Whiteouts follow the OCI layer spec and hold whatever order a layer lists its entries in:
//! a whiteout or opaque marker removes only what *lower* layers put there. The layer's own paths
//! are remembered while it is applied, and removal spares them (descending into this layer's
//! directories to remove the lower-layer children they merged with).

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use imp_api::names::reason;
use rustix::fs::{
    AtFlags, Dir, FileType, Gid, Mode, OFlags, ResolveFlags, Timespec, Timestamps, Uid, XattrFlags,
};
use rustix::io::Errno;

use super::Compression;

/// Character devices a layer may create (major, minor): the ones every container runtime
/// provides anyway. Anything giving hardware or kernel memory access (e.g. 1:1 /dev/mem) and all
/// block devices are refused.
pub const ALLOWED_CHAR_DEVICES: &[(u32, u32, &str)] = &[
    (1, 3, "null"),
    (1, 5, "zero"),
    (1, 7, "full"),
    (1, 8, "random"),
    (1, 9, "urandom"),
    (5, 0, "tty"),
    (5, 1, "console"),
    (5, 2, "ptmx"),
];

/// Caps over the whole image (all layers together), so a hostile image cannot fill the node's
/// disk or inode table through the work directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Decompressed tar bytes (headers and padding included) over all layers.
    pub max_unpacked_bytes: u64,
    /// Tar entries (whiteouts included) over all layers.
    pub max_entries: u64,
}

impl Default for Limits {
    /// 16 GiB holds the largest runner images in use (full toolchain images are 10-20 GB
    /// unpacked, the usual ones 1-3 GB) while staying well below the disk a node keeps for
    /// rootfs builds. 4 million entries is about eight times a full toolchain image and bounds
    /// both the ext4 inode count and the per-layer bookkeeping memory.
    fn default() -> Self {
        Limits {
            max_unpacked_bytes: 16 << 30,
            max_entries: 4_000_000,
        }
    }
}

/// What one layer contributed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// Tar entries read (whiteouts and ignored PAX global headers included).
    pub entries: u64,
    /// Decompressed bytes of this layer's tar stream.
    pub unpacked_bytes: u64,
    /// Whiteout files and opaque markers.
    pub whiteouts: u64,
}

/// Why a layer (or an injected file) could not be applied. Variants about one entry name the
/// layer (its digest) and the entry path as written in the tar.
#[derive(Debug, thiserror::Error)]
pub enum FlattenError {
    #[error("work directory {path}: {source}")]
    OpenRoot { path: PathBuf, source: io::Error },
    #[error("work directory {path} is not empty")]
    RootNotEmpty { path: PathBuf },
    #[error("layer {layer}: entry {entry:?}: path leaves the image root")]
    PathTraversal { layer: String, entry: String },
    #[error("layer {layer}: entry {entry:?}: absolute path")]
    AbsolutePath { layer: String, entry: String },
    #[error("layer {layer}: entry {entry:?}: name contains a NUL byte")]
    NulInName { layer: String, entry: String },
    #[error(
        "layer {layer}: entry {entry:?}: path goes through symlink {through:?}, which leaves the image root"
    )]
    SymlinkEscape {
        layer: String,
        entry: String,
        through: String,
    },
    #[error(
        "layer {layer}: entry {entry:?}: path goes through absolute symlink {through:?} -> {target:?}, which is only meaningful inside the guest"
    )]
    AbsoluteSymlinkInPath {
        layer: String,
        entry: String,
        through: String,
        target: String,
    },
    #[error("layer {layer}: entry {entry:?}: too many levels of symlinks in the path")]
    SymlinkLoop { layer: String, entry: String },
    #[error(
        "layer {layer}: entry {entry:?}: a parent path component is not a directory (a file or a dangling symlink)"
    )]
    ParentNotDirectory { layer: String, entry: String },
    #[error("layer {layer}: entry {entry:?}: only a directory may replace the image root")]
    RootReplaced { layer: String, entry: String },
    #[error("layer {layer}: entry {entry:?}: hardlink target {target:?} is outside the image root")]
    HardlinkEscape {
        layer: String,
        entry: String,
        target: String,
    },
    #[error(
        "layer {layer}: entry {entry:?}: hardlink target {target:?} does not exist in the image"
    )]
    HardlinkTargetMissing {
        layer: String,
        entry: String,
        target: String,
    },
    #[error("layer {layer}: entry {entry:?}: {kind} device {major}:{minor} is not allowed")]
    DeviceNotAllowed {
        layer: String,
        entry: String,
        kind: &'static str,
        major: u32,
        minor: u32,
    },
    #[error("layer {layer}: entry {entry:?}: unsupported entry type {kind}")]
    UnsupportedEntryType {
        layer: String,
        entry: String,
        kind: String,
    },
    #[error("layer {layer}: entry {entry:?}: whiteout names no sibling entry")]
    InvalidWhiteout { layer: String, entry: String },
    #[error("layer {layer}: entry {entry:?}: unpacked size exceeds the limit of {limit} bytes")]
    TooLarge {
        layer: String,
        entry: String,
        limit: u64,
    },
    #[error("layer {layer}: entry {entry:?}: more than {limit} entries in the image")]
    TooManyEntries {
        layer: String,
        entry: String,
        limit: u64,
    },
    #[error("layer {layer}: cannot decompress: {source}")]
    Decompress { layer: String, source: io::Error },
    /// The tar stream itself is broken; `entry` is the last entry read before it ("" if none).
    #[error("layer {layer}: entry {entry:?}: malformed tar: {source}")]
    Malformed {
        layer: String,
        entry: String,
        source: io::Error,
    },
    #[error("layer {layer}: entry {entry:?}: {op}: {source}")]
    Io {
        layer: String,
        entry: String,
        op: &'static str,
        source: io::Error,
    },
    #[error("cannot read {path} to inject it: {source}")]
    InjectSource { path: PathBuf, source: io::Error },
}

impl FlattenError {
    /// A short stable category for failure reasons and metric labels.
    pub fn reason(&self) -> &'static str {
        use FlattenError::*;
        match self {
            PathTraversal { .. }
            | AbsolutePath { .. }
            | NulInName { .. }
            | SymlinkEscape { .. }
            | AbsoluteSymlinkInPath { .. }
            | SymlinkLoop { .. }
            | ParentNotDirectory { .. }
            | RootReplaced { .. }
            | HardlinkEscape { .. }
            | HardlinkTargetMissing { .. }
            | DeviceNotAllowed { .. }
            | UnsupportedEntryType { .. }
            | InvalidWhiteout { .. } => reason::LAYER_REJECTED,
            TooLarge { .. } | TooManyEntries { .. } => reason::LAYER_TOO_LARGE,
            Decompress { .. } | Malformed { .. } => reason::LAYER_UNREADABLE,
            RootNotEmpty { .. } => reason::WORK_DIR_NOT_EMPTY,
            OpenRoot { .. } | Io { .. } | InjectSource { .. } => reason::HOST_IO_FAILED,
        }
    }
}

impl FlattenError {
    /// The layer is at fault (hostile, oversized or corrupt), not this host.
    pub fn is_image_fault(&self) -> bool {
        matches!(
            self.reason(),
            reason::LAYER_REJECTED | reason::LAYER_TOO_LARGE | reason::LAYER_UNREADABLE
        )
    }
}

/// The layer label in errors from [`Flattener::inject_file`] and [`Flattener::ensure_dir`].
const INJECTED: &str = "(injected)";

/// Applies layers to one work directory; see the module documentation for the rules.
pub struct Flattener {
    root: OwnedFd,
    limits: Limits,
    unpacked_bytes: u64,
    entries: u64,
}

impl Flattener {
    /// `root` must be an existing, empty directory; it is opened once and every later operation
    /// is relative to that fd.
    pub fn new(root: &Path, limits: Limits) -> Result<Self, FlattenError> {
        let open_err = |e: io::Error| FlattenError::OpenRoot {
            path: root.to_path_buf(),
            source: e,
        };
        let fd = rustix::fs::open(
            root,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| open_err(e.into()))?;
        if !child_names(fd.as_fd()).map_err(open_err)?.is_empty() {
            return Err(FlattenError::RootNotEmpty {
                path: root.to_path_buf(),
            });
        }
        Ok(Flattener {
            root: fd,
            limits,
            unpacked_bytes: 0,
            entries: 0,
        })
    }

    /// Bytes unpacked so far over all layers (counts toward `max_unpacked_bytes`).
    pub fn unpacked_bytes(&self) -> u64 {
        self.unpacked_bytes
    }

    /// Apply one layer blob (already digest-verified by the caller) on top of the earlier ones.
    /// `layer` names it in errors (the digest).
    pub fn apply_layer(
        &mut self,
        layer: &str,
        blob: impl Read,
        compression: Compression,
    ) -> Result<LayerStats, FlattenError> {
        let budget = self
            .limits
            .max_unpacked_bytes
            .saturating_sub(self.unpacked_bytes);
        let meter = Rc::new(Meter {
            limit: self.limits.max_unpacked_bytes,
            budget,
            consumed: Cell::new(0),
            failure: Cell::new(None),
        });
        let decoded: Box<dyn Read + '_> = match compression {
            Compression::None => Box::new(blob),
            Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(blob)),
            Compression::Zstd => Box::new(ZstdFrames::new(blob)),
        };
        let mut archive = tar::Archive::new(Metered {
            inner: decoded,
            meter: Rc::clone(&meter),
        });
        let mut state = LayerState {
            layer,
            meter: &meter,
            last_entry: String::new(),
            created: BTreeSet::new(),
            dirs: BTreeMap::new(),
            stats: LayerStats::default(),
        };
        let applied = self.apply_entries(&mut archive, &mut state);
        // Counted even on failure: the caller may go on to report the total.
        self.unpacked_bytes += meter.consumed.get();
        applied?;
        self.finish_dirs(&state)?;
        state.stats.unpacked_bytes = meter.consumed.get();
        Ok(state.stats)
    }

    /// Place a host file into the tree (the static guest agent at /sbin/imp-guest), resolving
    /// the destination with the same rules as layer entries (so through a usrmerge
    /// `sbin -> usr/sbin` symlink), creating missing parent dirs 0755 root:root and replacing
    /// whatever is there. The file is owned by root with exactly `mode`.
    pub fn inject_file(&mut self, dest: &str, src: &Path, mode: u32) -> Result<(), FlattenError> {
        let ctx = Ctx::new(INJECTED, dest.as_bytes());
        let (parent, name) = self.prepare_own_path(&ctx, dest)?;
        let name = OsStr::from_bytes(&name);
        let mut source = File::open(src).map_err(|e| FlattenError::InjectSource {
            path: src.to_path_buf(),
            source: e,
        })?;
        remove_any(parent.as_fd(), name).map_err(|e| ctx.io("remove existing entry", e))?;
        let mut file = create_file(parent.as_fd(), name).map_err(|e| ctx.io("create file", e))?;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = source
                .read(&mut buf)
                .map_err(|e| FlattenError::InjectSource {
                    path: src.to_path_buf(),
                    source: e,
                })?;
            if n == 0 {
                break;
            }
            file.write_all(&buf[..n])
                .map_err(|e| ctx.io("write file", e))?;
        }
        rustix::fs::fchown(&file, Some(Uid::ROOT), Some(Gid::ROOT))
            .map_err(|e| ctx.io("chown", e))?;
        rustix::fs::fchmod(&file, Mode::from_raw_mode(mode & 0o7777))
            .map_err(|e| ctx.io("chmod", e))?;
        Ok(())
    }

    /// Make sure a directory exists (the mount points /proc /sys /dev /run /tmp the guest
    /// needs). One the image already has is kept as it is; anything else there is replaced by a
    /// directory owned by root with `mode`.
    pub fn ensure_dir(&mut self, path: &str, mode: u32) -> Result<(), FlattenError> {
        let ctx = Ctx::new(INJECTED, path.as_bytes());
        let (parent, name) = self.prepare_own_path(&ctx, path)?;
        let name = OsStr::from_bytes(&name);
        match rustix::fs::statat(&parent, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => return Ok(()),
            _ => {}
        }
        remove_any(parent.as_fd(), name).map_err(|e| ctx.io("remove existing entry", e))?;
        make_dir(parent.as_fd(), name, mode).map_err(|e| ctx.io("create directory", e))
    }

    /// For our own absolute paths (inject, ensure_dir): the parent fd (created as needed) and the
    /// last component.
    fn prepare_own_path(&self, ctx: &Ctx, path: &str) -> Result<(OwnedFd, Vec<u8>), FlattenError> {
        let rel = normalize(path.trim_start_matches('/').as_bytes()).map_err(|p| ctx.name(p))?;
        let Some((name, parent_rel)) = rel.split_last() else {
            return Err(ctx.rejected(|layer, entry| FlattenError::RootReplaced { layer, entry }));
        };
        let parent = self
            .make_dirs(parent_rel, &mut BTreeSet::new())
            .map_err(|r| ctx.refusal(r, "resolve parent directory"))?;
        Ok((parent, name.clone()))
    }

    fn apply_entries<R: Read>(
        &mut self,
        archive: &mut tar::Archive<R>,
        state: &mut LayerState,
    ) -> Result<(), FlattenError> {
        let entries = archive.entries().map_err(|e| state.read_failure(e))?;
        for entry in entries {
            let mut entry = entry.map_err(|e| state.read_failure(e))?;
            let raw_name = entry.path_bytes().into_owned();
            state.last_entry = String::from_utf8_lossy(&raw_name).into_owned();
            state.stats.entries += 1;
            self.entries += 1;
            let ctx = Ctx::new(state.layer, &raw_name);
            if self.entries > self.limits.max_entries {
                let limit = self.limits.max_entries;
                return Err(ctx.rejected(|layer, entry| FlattenError::TooManyEntries {
                    layer,
                    entry,
                    limit,
                }));
            }
            self.apply_entry(&ctx, &raw_name, &mut entry, state)?;
        }
        Ok(())
    }

    fn apply_entry<R: Read>(
        &mut self,
        ctx: &Ctx,
        raw_name: &[u8],
        entry: &mut tar::Entry<R>,
        state: &mut LayerState,
    ) -> Result<(), FlattenError> {
        let kind = entry.header().entry_type();
        if kind == tar::EntryType::XGlobalHeader {
            return Ok(()); // archive-wide comments (e.g. git's commit id): no file
        }
        let rel = normalize(raw_name).map_err(|p| ctx.name(p))?;
        let pax = pax_records(entry).map_err(|e| state.read_failure(e))?;
        let meta = Meta::read(entry.header(), &pax).map_err(|e| ctx.malformed(e))?;

        let Some((name, parent_rel)) = rel.split_last() else {
            // "./": the image root itself, which only a directory entry may describe.
            if kind != tar::EntryType::Directory {
                return Err(
                    ctx.rejected(|layer, entry| FlattenError::RootReplaced { layer, entry })
                );
            }
            rustix::fs::fchown(&self.root, Some(meta.uid), Some(meta.gid))
                .map_err(|e| ctx.io("chown", e))?;
            state.dirs.insert(Vec::new(), meta);
            return Ok(());
        };

        if let Some(marker) = whiteout(name) {
            state.stats.whiteouts += 1;
            return self.apply_whiteout(ctx, parent_rel, marker, state);
        }

        let parent = self
            .make_dirs(parent_rel, &mut state.created)
            .map_err(|r| ctx.refusal(r, "resolve parent directory"))?;
        let parent = parent.as_fd();
        let name_os = OsStr::from_bytes(name);
        let key = join(&rel);
        match kind {
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                if pax.iter().any(|(k, _)| k.starts_with("GNU.sparse.")) {
                    return Err(ctx.unsupported("PAX sparse file".into()));
                }
                remove_any(parent, name_os).map_err(|e| ctx.io("remove existing entry", e))?;
                let mut file =
                    create_file(parent, name_os).map_err(|e| ctx.io("create file", e))?;
                copy_content(ctx, entry, &mut file, state)?;
                // chown clears setuid bits and file capabilities, so it goes first.
                rustix::fs::fchown(&file, Some(meta.uid), Some(meta.gid))
                    .map_err(|e| ctx.io("chown", e))?;
                rustix::fs::fchmod(&file, meta.mode).map_err(|e| ctx.io("chmod", e))?;
                set_xattrs(ctx, file.as_fd(), &pax)?;
                rustix::fs::futimens(&file, &meta.times()).map_err(|e| ctx.io("set mtime", e))?;
            }
            tar::EntryType::Directory => {
                let is_dir = matches!(
                    rustix::fs::statat(parent, name_os, AtFlags::SYMLINK_NOFOLLOW),
                    Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory
                );
                if !is_dir {
                    remove_any(parent, name_os).map_err(|e| ctx.io("remove existing entry", e))?;
                    // 0755 until the layer ends, so a read-only directory still takes children.
                    make_dir(parent, name_os, 0o755).map_err(|e| ctx.io("create directory", e))?;
                }
                let dir = open_dir_nofollow(parent, name_os, OFlags::RDONLY)
                    .map_err(|e| ctx.io("open directory", e))?;
                rustix::fs::fchown(&dir, Some(meta.uid), Some(meta.gid))
                    .map_err(|e| ctx.io("chown", e))?;
                set_xattrs(ctx, dir.as_fd(), &pax)?;
                state.dirs.insert(key.clone(), meta);
            }
            tar::EntryType::Symlink => {
                let target = entry.link_name_bytes().unwrap_or_default().into_owned();
                remove_any(parent, name_os).map_err(|e| ctx.io("remove existing entry", e))?;
                rustix::fs::symlinkat(OsStr::from_bytes(&target), parent, name_os)
                    .map_err(|e| ctx.io("create symlink", e))?;
                // xattrs are skipped: Linux refuses user.* on symlinks and capabilities
                // only mean something on regular files.
                meta.apply_at(ctx, parent, name_os, false)?;
            }
            tar::EntryType::Link => {
                let target = entry.link_name_bytes().unwrap_or_default().into_owned();
                self.hardlink(ctx, parent, name_os, &rel, &target)?;
            }
            tar::EntryType::Char => {
                let (major, minor) = device_numbers(ctx, entry)?;
                if !ALLOWED_CHAR_DEVICES
                    .iter()
                    .any(|&(ma, mi, _)| (ma, mi) == (major, minor))
                {
                    return Err(ctx.rejected(|layer, entry| FlattenError::DeviceNotAllowed {
                        layer,
                        entry,
                        kind: "character",
                        major,
                        minor,
                    }));
                }
                remove_any(parent, name_os).map_err(|e| ctx.io("remove existing entry", e))?;
                let dev = rustix::fs::makedev(major, minor);
                rustix::fs::mknodat(parent, name_os, FileType::CharacterDevice, meta.mode, dev)
                    .map_err(|e| ctx.io("create device node", e))?;
                meta.apply_at(ctx, parent, name_os, true)?;
            }
            tar::EntryType::Block => {
                let (major, minor) = device_numbers(ctx, entry)?;
                return Err(ctx.rejected(|layer, entry| FlattenError::DeviceNotAllowed {
                    layer,
                    entry,
                    kind: "block",
                    major,
                    minor,
                }));
            }
            tar::EntryType::Fifo => {
                remove_any(parent, name_os).map_err(|e| ctx.io("remove existing entry", e))?;
                rustix::fs::mknodat(parent, name_os, FileType::Fifo, meta.mode, 0)
                    .map_err(|e| ctx.io("create fifo", e))?;
                meta.apply_at(ctx, parent, name_os, true)?;
            }
            tar::EntryType::GNUSparse => return Err(ctx.unsupported("GNU sparse file".into())),
            other => {
                return Err(ctx.unsupported(format!("type byte {:?}", other.as_byte() as char)));
            }
        }
        state.created.insert(key);
        Ok(())
    }

    /// A hardlink to a path already in the tree (from this or a lower layer). The target is
    /// resolved like any entry path; linkat without AT_SYMLINK_FOLLOW links a symlink itself.
    fn hardlink(
        &self,
        ctx: &Ctx,
        parent: BorrowedFd,
        name: &OsStr,
        rel: &[Vec<u8>],
        raw_target: &[u8],
    ) -> Result<(), FlattenError> {
        let target_text = String::from_utf8_lossy(raw_target).into_owned();
        let escape = || {
            ctx.rejected(|layer, entry| FlattenError::HardlinkEscape {
                layer,
                entry,
                target: target_text.clone(),
            })
        };
        let missing = || {
            ctx.rejected(|layer, entry| FlattenError::HardlinkTargetMissing {
                layer,
                entry,
                target: target_text.clone(),
            })
        };
        let target = match normalize(raw_target) {
            Ok(target) => target,
            Err(NameProblem::Nul) => return Err(ctx.name(NameProblem::Nul)),
            Err(_) => return Err(escape()),
        };
        if target == rel {
            return Ok(()); // a link to itself: the file is already there
        }
        let Some((target_name, target_parent_rel)) = target.split_last() else {
            return Err(missing()); // the root directory cannot be hardlinked
        };
        let target_parent = match self.resolve_dir(target_parent_rel) {
            Ok(fd) => fd,
            Err(Refusal::Missing | Refusal::NotDirectory) => return Err(missing()),
            Err(Refusal::Os(e)) => return Err(ctx.io("resolve hardlink target", e)),
            Err(_) => return Err(escape()),
        };
        let target_name = OsStr::from_bytes(target_name);
        match rustix::fs::statat(&target_parent, target_name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(_) => {}
            Err(Errno::NOENT) => return Err(missing()),
            Err(e) => return Err(ctx.io("inspect hardlink target", e)),
        }
        remove_any(parent, name).map_err(|e| ctx.io("remove existing entry", e))?;
        rustix::fs::linkat(&target_parent, target_name, parent, name, AtFlags::empty())
            .map_err(|e| ctx.io("create hardlink", e))
    }

    /// `.wh.<name>` removes `<name>` as lower layers left it; `.wh..wh..opq` removes every
    /// lower-layer child of its directory. Neither is written, and neither creates directories.
    fn apply_whiteout(
        &self,
        ctx: &Ctx,
        dir_rel: &[Vec<u8>],
        marker: Whiteout,
        state: &LayerState,
    ) -> Result<(), FlattenError> {
        let target: &[u8] = match marker {
            Whiteout::AufsMeta => return Ok(()), // aufs bookkeeping (.wh..wh.plnk etc.): no file
            Whiteout::Opaque => b"",
            Whiteout::Entry(b"") => {
                return Err(
                    ctx.rejected(|layer, entry| FlattenError::InvalidWhiteout { layer, entry })
                );
            }
            // `.wh..` would remove its own directory (the root itself at top level), `.wh...`
            // the one above.
            Whiteout::Entry(b".") | Whiteout::Entry(b"..") => {
                return Err(
                    ctx.rejected(|layer, entry| FlattenError::PathTraversal { layer, entry })
                );
            }
            Whiteout::Entry(name) => name,
        };
        let dir = match self.resolve_dir(dir_rel) {
            Ok(fd) => fd,
            // Nothing below to remove.
            Err(Refusal::Missing | Refusal::NotDirectory) => return Ok(()),
            Err(r) => return Err(ctx.refusal(r, "resolve whiteout directory")),
        };
        let mut path = dir_rel.to_vec();
        let removed = if target.is_empty() {
            child_names(dir.as_fd()).and_then(|names| {
                names.into_iter().try_for_each(|child| {
                    path.push(child.into_bytes());
                    let done = prune(dir.as_fd(), &path, &state.created);
                    path.pop();
                    done
                })
            })
        } else {
            path.push(target.to_vec());
            prune(dir.as_fd(), &path, &state.created)
        };
        removed.map_err(|e| ctx.io("apply whiteout", e))
    }

    /// Directory modes and mtimes, applied once the layer's entries are all in place (a read-only
    /// directory must not stop its children being written, and adding children moves mtimes).
    /// A directory that a later entry of the layer replaced or removed is skipped.
    fn finish_dirs(&self, state: &LayerState) -> Result<(), FlattenError> {
        for (key, meta) in &state.dirs {
            let ctx = Ctx::new(state.layer, key);
            let dir = if key.is_empty() {
                rustix::io::dup(&self.root).map_err(|e| ctx.io("open directory", e))?
            } else {
                let rel = split(key);
                let (name, parent_rel) = rel.split_last().expect("non-empty key");
                let Ok(parent) = self.resolve_dir(parent_rel) else {
                    continue;
                };
                match open_dir_nofollow(parent.as_fd(), OsStr::from_bytes(name), OFlags::RDONLY) {
                    Ok(dir) => dir,
                    Err(Errno::NOENT | Errno::NOTDIR | Errno::LOOP) => continue,
                    Err(e) => return Err(ctx.io("open directory", e)),
                }
            };
            rustix::fs::fchmod(&dir, meta.mode).map_err(|e| ctx.io("chmod", e))?;
            rustix::fs::futimens(&dir, &meta.times()).map_err(|e| ctx.io("set mtime", e))?;
        }
        Ok(())
    }

    /// Opens directory `rel` beneath the root (O_PATH), following only symlinks that stay inside.
    fn resolve_dir(&self, rel: &[Vec<u8>]) -> Result<OwnedFd, Refusal> {
        let path = if rel.is_empty() {
            b".".to_vec()
        } else {
            join(rel)
        };
        let opened = rustix::fs::openat2(
            &self.root,
            OsStr::from_bytes(&path),
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
        );
        match opened {
            Ok(fd) => Ok(fd),
            Err(Errno::NOENT) => Err(Refusal::Missing),
            Err(Errno::NOTDIR) => Err(Refusal::NotDirectory),
            Err(e @ (Errno::XDEV | Errno::LOOP)) => Err(self.diagnose(rel, e)),
            Err(e) => Err(Refusal::Os(e.into())),
        }
    }

    /// Like `resolve_dir`, creating missing directories one component at a time (0755,
    /// root:root) relative to the already resolved parent; they count as this layer's paths.
    fn make_dirs(
        &self,
        rel: &[Vec<u8>],
        created: &mut BTreeSet<Vec<u8>>,
    ) -> Result<OwnedFd, Refusal> {
        match self.resolve_dir(rel) {
            Err(Refusal::Missing) => {}
            resolved => return resolved,
        }
        let mut parent = self.resolve_dir(&[])?;
        for depth in 1..=rel.len() {
            parent = match self.resolve_dir(&rel[..depth]) {
                Ok(fd) => fd,
                Err(Refusal::Missing) => {
                    let name = OsStr::from_bytes(&rel[depth - 1]);
                    match make_dir(parent.as_fd(), name, 0o755) {
                        Ok(()) => {}
                        // Present yet not resolvable: a dangling symlink.
                        Err(Errno::EXIST) => return Err(Refusal::NotDirectory),
                        Err(e) => return Err(Refusal::Os(e.into())),
                    }
                    created.insert(join(&rel[..depth]));
                    open_dir_nofollow(parent.as_fd(), name, OFlags::PATH)
                        .map_err(|e| Refusal::Os(e.into()))?
                }
                Err(refusal) => return Err(refusal),
            };
        }
        Ok(parent)
    }

    /// After the kernel refused a resolution: walk the path the way it would, reading the links,
    /// to say which symlink was to blame. Diagnostics only; nothing here decides safety.
    fn diagnose(&self, rel: &[Vec<u8>], errno: Errno) -> Refusal {
        let mut resolved: Vec<Vec<u8>> = Vec::new();
        let mut pending: VecDeque<Vec<u8>> = rel.iter().cloned().collect();
        let mut last_link = String::new();
        let mut hops = 0;
        while let Some(component) = pending.pop_front() {
            match component.as_slice() {
                b"" | b"." => continue,
                b".." => {
                    if resolved.pop().is_none() {
                        return Refusal::Escapes { through: last_link };
                    }
                    continue;
                }
                _ => {}
            }
            resolved.push(component);
            let here = join(&resolved);
            let Ok(target) =
                rustix::fs::readlinkat(&self.root, OsStr::from_bytes(&here), Vec::new())
            else {
                continue; // not a symlink (or missing): a plain component
            };
            hops += 1;
            if hops > 40 {
                return Refusal::Loop;
            }
            let target = target.into_bytes();
            let through = String::from_utf8_lossy(&here).into_owned();
            if target.starts_with(b"/") {
                return Refusal::AbsoluteSymlink {
                    through,
                    target: String::from_utf8_lossy(&target).into_owned(),
                };
            }
            resolved.pop();
            for part in target.split(|&b| b == b'/').rev() {
                pending.push_front(part.to_vec());
            }
            last_link = through;
        }
        match errno {
            Errno::LOOP => Refusal::Loop,
            e => Refusal::Os(e.into()),
        }
    }
}

/// Why a directory could not be resolved beneath the root.
#[derive(Debug)]
enum Refusal {
    Missing,
    NotDirectory,
    Escapes { through: String },
    AbsoluteSymlink { through: String, target: String },
    Loop,
    Os(io::Error),
}

/// The state of the layer being applied.
struct LayerState<'a> {
    layer: &'a str,
    meter: &'a Meter,
    /// The entry most recently read, for errors that happen between entries.
    last_entry: String,
    /// Paths this layer created (as written, normalized), which its whiteouts spare.
    created: BTreeSet<Vec<u8>>,
    /// Directory entries whose mode and mtime are applied when the layer ends.
    dirs: BTreeMap<Vec<u8>, Meta>,
    stats: LayerStats,
}

impl LayerState<'_> {
    /// Classify a failed read of the tar stream by what the meter saw beneath it.
    fn read_failure(&self, source: io::Error) -> FlattenError {
        let layer = self.layer.to_string();
        let entry = self.last_entry.clone();
        match self.meter.failure.get() {
            Some(ReadFailure::OverLimit) => FlattenError::TooLarge {
                layer,
                entry,
                limit: self.meter.limit,
            },
            Some(ReadFailure::Decoder) => FlattenError::Decompress { layer, source },
            None => FlattenError::Malformed {
                layer,
                entry,
                source,
            },
        }
    }
}

/// The layer and entry an error is about.
struct Ctx<'a> {
    layer: &'a str,
    entry: String,
}

impl<'a> Ctx<'a> {
    fn new(layer: &'a str, raw_entry: &[u8]) -> Self {
        Ctx {
            layer,
            entry: String::from_utf8_lossy(raw_entry).into_owned(),
        }
    }

    fn rejected(&self, variant: impl FnOnce(String, String) -> FlattenError) -> FlattenError {
        variant(self.layer.to_string(), self.entry.clone())
    }

    fn io(&self, op: &'static str, source: impl Into<io::Error>) -> FlattenError {
        FlattenError::Io {
            layer: self.layer.to_string(),
            entry: self.entry.clone(),
            op,
            source: source.into(),
        }
    }

    fn malformed(&self, source: io::Error) -> FlattenError {
        FlattenError::Malformed {
            layer: self.layer.to_string(),
            entry: self.entry.clone(),
            source,
        }
    }

    fn unsupported(&self, kind: String) -> FlattenError {
        self.rejected(|layer, entry| FlattenError::UnsupportedEntryType { layer, entry, kind })
    }

    fn name(&self, problem: NameProblem) -> FlattenError {
        match problem {
            NameProblem::Absolute => {
                self.rejected(|layer, entry| FlattenError::AbsolutePath { layer, entry })
            }
            NameProblem::DotDot => {
                self.rejected(|layer, entry| FlattenError::PathTraversal { layer, entry })
            }
            NameProblem::Nul => {
                self.rejected(|layer, entry| FlattenError::NulInName { layer, entry })
            }
        }
    }

    fn refusal(&self, refusal: Refusal, op: &'static str) -> FlattenError {
        match refusal {
            Refusal::Missing => self.io(op, Errno::NOENT),
            Refusal::NotDirectory => {
                self.rejected(|layer, entry| FlattenError::ParentNotDirectory { layer, entry })
            }
            Refusal::Escapes { through } => {
                self.rejected(|layer, entry| FlattenError::SymlinkEscape {
                    layer,
                    entry,
                    through,
                })
            }
            Refusal::AbsoluteSymlink { through, target } => {
                self.rejected(|layer, entry| FlattenError::AbsoluteSymlinkInPath {
                    layer,
                    entry,
                    through,
                    target,
                })
            }
            Refusal::Loop => {
                self.rejected(|layer, entry| FlattenError::SymlinkLoop { layer, entry })
            }
            Refusal::Os(e) => self.io(op, e),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NameProblem {
    Absolute,
    DotDot,
    Nul,
}

/// An entry name as components: `./` prefixes, `.` and empty components dropped. Absolute names
/// and any `..` are refused outright (a `..` that would stay inside is not worth the risk).
fn normalize(raw: &[u8]) -> Result<Vec<Vec<u8>>, NameProblem> {
    if raw.contains(&0) {
        return Err(NameProblem::Nul);
    }
    if raw.starts_with(b"/") {
        return Err(NameProblem::Absolute);
    }
    let mut parts = Vec::new();
    for part in raw.split(|&b| b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => return Err(NameProblem::DotDot),
            _ => parts.push(part.to_vec()),
        }
    }
    Ok(parts)
}

fn join(rel: &[Vec<u8>]) -> Vec<u8> {
    rel.join(&b'/')
}

fn split(key: &[u8]) -> Vec<Vec<u8>> {
    key.split(|&b| b == b'/').map(<[u8]>::to_vec).collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Whiteout<'n> {
    /// `.wh.<name>`
    Entry(&'n [u8]),
    /// `.wh..wh..opq`
    Opaque,
    /// Other `.wh..wh.` names: aufs bookkeeping, ignored as Docker does.
    AufsMeta,
}

fn whiteout(name: &[u8]) -> Option<Whiteout<'_>> {
    if name == b".wh..wh..opq" {
        Some(Whiteout::Opaque)
    } else if name.starts_with(b".wh..wh.") {
        Some(Whiteout::AufsMeta)
    } else {
        name.strip_prefix(b".wh.").map(Whiteout::Entry)
    }
}

/// Removes what lower layers left at `rel` (a child of `dir`), sparing what this layer created:
/// a path it created is kept, and a directory holding paths it created is kept and pruned
/// child by child.
fn prune(dir: BorrowedFd, rel: &[Vec<u8>], created: &BTreeSet<Vec<u8>>) -> io::Result<()> {
    let key = join(rel);
    let name = OsStr::from_bytes(rel.last().expect("prune names a child"));
    let mut prefix = key.clone();
    prefix.push(b'/');
    let created_below = created
        .range(prefix.clone()..)
        .next()
        .is_some_and(|p| p.starts_with(&prefix));
    if !created.contains(&key) && !created_below {
        return remove_any(dir, name);
    }
    let sub = match open_dir_nofollow(dir, name, OFlags::RDONLY) {
        Ok(sub) => sub,
        // This layer's own non-directory (or nothing left there): keep.
        Err(Errno::NOTDIR | Errno::LOOP | Errno::NOENT) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    let mut path = rel.to_vec();
    for child in child_names(sub.as_fd())? {
        path.push(child.into_bytes());
        prune(sub.as_fd(), &path, created)?;
        path.pop();
    }
    Ok(())
}

/// Removes `name` in `dir` whatever it is, never following a symlink; a directory is emptied
/// through its own fd first. A missing name is fine.
fn remove_any(dir: BorrowedFd, name: &OsStr) -> io::Result<()> {
    let stat = match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(stat) => stat,
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    if FileType::from_raw_mode(stat.st_mode) == FileType::Directory {
        let sub = open_dir_nofollow(dir, name, OFlags::RDONLY)?;
        for child in child_names(sub.as_fd())? {
            remove_any(sub.as_fd(), OsStr::from_bytes(child.as_bytes()))?;
        }
        rustix::fs::unlinkat(dir, name, AtFlags::REMOVEDIR)?;
    } else {
        rustix::fs::unlinkat(dir, name, AtFlags::empty())?;
    }
    Ok(())
}

/// The names in a directory, without `.` and `..`, read before anything is changed in it.
fn child_names(dir: BorrowedFd) -> io::Result<Vec<CString>> {
    let readable = rustix::fs::openat(
        dir,
        c".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let mut names = Vec::new();
    for entry in Dir::new(readable)? {
        let name = entry?.file_name().to_owned();
        if name.as_bytes() != b"." && name.as_bytes() != b".." {
            names.push(name);
        }
    }
    Ok(names)
}

fn open_dir_nofollow(dir: BorrowedFd, name: &OsStr, access: OFlags) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat(
        dir,
        name,
        access | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// A new directory, root-owned, with exactly `mode` (mkdir alone would apply the umask and
/// could inherit a setgid parent's group).
fn make_dir(parent: BorrowedFd, name: &OsStr, mode: u32) -> rustix::io::Result<()> {
    rustix::fs::mkdirat(parent, name, Mode::from_raw_mode(0o700))?;
    let dir = open_dir_nofollow(parent, name, OFlags::RDONLY)?;
    rustix::fs::fchown(&dir, Some(Uid::ROOT), Some(Gid::ROOT))?;
    rustix::fs::fchmod(&dir, Mode::from_raw_mode(mode & 0o7777))
}

/// A new, empty regular file that did not exist before, never through a symlink.
fn create_file(parent: BorrowedFd, name: &OsStr) -> rustix::io::Result<File> {
    let fd = rustix::fs::openat(
        parent,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )?;
    Ok(File::from(fd))
}

/// Entry content into `file`, telling read failures (the layer) from write failures (the host).
fn copy_content(
    ctx: &Ctx,
    entry: &mut impl Read,
    file: &mut File,
    state: &LayerState,
) -> Result<(), FlattenError> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = entry.read(&mut buf).map_err(|e| state.read_failure(e))?;
        if n == 0 {
            return Ok(());
        }
        file.write_all(&buf[..n])
            .map_err(|e| ctx.io("write file", e))?;
    }
}

/// The PAX records of an entry (uid, gid and size the tar crate already applied).
fn pax_records<R: Read>(entry: &mut tar::Entry<R>) -> io::Result<Vec<(String, Vec<u8>)>> {
    let Some(extensions) = entry.pax_extensions()? else {
        return Ok(Vec::new());
    };
    let mut records = Vec::new();
    for record in extensions {
        let record = record?;
        let key = String::from_utf8_lossy(record.key_bytes()).into_owned();
        records.push((key, record.value_bytes().to_vec()));
    }
    Ok(records)
}

/// xattrs from `SCHILY.xattr.*` records. Only `security.capability` (file capabilities, e.g.
/// ping's cap_net_raw) and `user.*` are set: `trusted.*` and other `security.*` names are host
/// policy (SELinux labels, overlayfs internals) that an image must not choose, and POSIX ACLs are
/// out of scope.
fn set_xattrs(ctx: &Ctx, fd: BorrowedFd, pax: &[(String, Vec<u8>)]) -> Result<(), FlattenError> {
    for (key, value) in pax {
        let Some(name) = key.strip_prefix("SCHILY.xattr.") else {
            continue;
        };
        if name == "security.capability" || name.starts_with("user.") {
            rustix::fs::fsetxattr(fd, name, value, XattrFlags::empty())
                .map_err(|e| ctx.io("set xattr", e))?;
        }
    }
    Ok(())
}

fn device_numbers<R: Read>(ctx: &Ctx, entry: &tar::Entry<R>) -> Result<(u32, u32), FlattenError> {
    let header = entry.header();
    let major = header.device_major().map_err(|e| ctx.malformed(e))?;
    let minor = header.device_minor().map_err(|e| ctx.malformed(e))?;
    Ok((major.unwrap_or(0), minor.unwrap_or(0)))
}

/// Owner, permission bits (setuid/setgid/sticky included) and mtime of an entry.
#[derive(Debug, Clone, Copy)]
struct Meta {
    uid: Uid,
    gid: Gid,
    mode: Mode,
    mtime: Timespec,
}

impl Meta {
    fn read(header: &tar::Header, pax: &[(String, Vec<u8>)]) -> io::Result<Meta> {
        let id = |value: u64, what: &str| {
            u32::try_from(value)
                .ok()
                .filter(|&v| v != u32::MAX)
                .ok_or_else(|| io::Error::other(format!("{what} {value} out of range")))
        };
        let mtime = match pax.iter().find(|(k, _)| k == "mtime") {
            Some((_, value)) => parse_pax_time(value)
                .ok_or_else(|| io::Error::other("PAX mtime is not a timestamp"))?,
            None => Timespec {
                tv_sec: i64::try_from(header.mtime()?).unwrap_or(i64::MAX),
                tv_nsec: 0,
            },
        };
        Ok(Meta {
            uid: Uid::from_raw(id(header.uid()?, "uid")?),
            gid: Gid::from_raw(id(header.gid()?, "gid")?),
            mode: Mode::from_raw_mode(header.mode()? & 0o7777),
            mtime,
        })
    }

    fn times(&self) -> Timestamps {
        Timestamps {
            last_access: self.mtime,
            last_modification: self.mtime,
        }
    }

    /// Owner, then mode (chown clears setuid bits), then mtime, on a node just made in `dir`
    /// that cannot be opened for writing (symlink, device, fifo). A symlink has no mode of its
    /// own, so `chmod` is false for it.
    fn apply_at(
        &self,
        ctx: &Ctx,
        dir: BorrowedFd,
        name: &OsStr,
        chmod: bool,
    ) -> Result<(), FlattenError> {
        rustix::fs::chownat(
            dir,
            name,
            Some(self.uid),
            Some(self.gid),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|e| ctx.io("chown", e))?;
        if chmod {
            // The node was just made by this process in a directory only it writes to.
            rustix::fs::chmodat(dir, name, self.mode, AtFlags::empty())
                .map_err(|e| ctx.io("chmod", e))?;
        }
        rustix::fs::utimensat(dir, name, &self.times(), AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| ctx.io("set mtime", e))
    }
}

/// A PAX time: decimal seconds, optionally negative, optionally with a fraction.
fn parse_pax_time(value: &[u8]) -> Option<Timespec> {
    let text = std::str::from_utf8(value).ok()?;
    let (secs, frac) = text.split_once('.').unwrap_or((text, ""));
    let tv_sec: i64 = secs.parse().ok()?;
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let digits: String = frac.chars().chain(std::iter::repeat('0')).take(9).collect();
    let mut tv_nsec: i64 = digits.parse().ok()?;
    if secs.starts_with('-') && tv_nsec != 0 {
        // -1.5 is 1.5 s before the epoch: seconds -2, plus 0.5 s.
        return Some(Timespec {
            tv_sec: tv_sec - 1,
            tv_nsec: 1_000_000_000 - tv_nsec,
        });
    }
    tv_nsec = tv_nsec.min(999_999_999);
    Some(Timespec { tv_sec, tv_nsec })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReadFailure {
    /// The decompressor (or the blob beneath it) failed.
    Decoder,
    /// More decompressed bytes than the image may still have.
    OverLimit,
}

/// Shared between the reader the tar parser owns and the code that reports its errors.
struct Meter {
    /// The image-wide limit, for the error.
    limit: u64,
    /// What is left of it for this layer.
    budget: u64,
    consumed: Cell<u64>,
    failure: Cell<Option<ReadFailure>>,
}

/// Counts decompressed bytes and stops once they pass the budget, whatever the headers claim.
struct Metered<R> {
    inner: R,
    meter: Rc<Meter>,
}

impl<R: Read> Read for Metered<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf).inspect_err(|e| {
            if e.kind() != io::ErrorKind::Interrupted {
                self.meter.failure.set(Some(ReadFailure::Decoder));
            }
        })?;
        let consumed = self.meter.consumed.get() + n as u64;
        self.meter.consumed.set(consumed);
        if consumed > self.meter.budget {
            self.meter.failure.set(Some(ReadFailure::OverLimit));
            return Err(io::Error::other("unpacked size limit exceeded"));
        }
        Ok(n)
    }
}

/// Every frame of a zstd stream, in order: parallel compressors and zstd:chunked write several,
/// and skippable frames (zstd:chunked metadata) are skipped. ruzstd's StreamingDecoder does one.
struct ZstdFrames<R> {
    source: BufReader<R>,
    decoder: ruzstd::decoding::FrameDecoder,
    in_frame: bool,
}

impl<R: Read> ZstdFrames<R> {
    fn new(source: R) -> Self {
        ZstdFrames {
            source: BufReader::new(source),
            decoder: ruzstd::decoding::FrameDecoder::new(),
            in_frame: false,
        }
    }
}

impl<R: Read> Read for ZstdFrames<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use ruzstd::decoding::BlockDecodingStrategy;
        use ruzstd::decoding::errors::{FrameDecoderError, ReadFrameHeaderError};
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            if self.in_frame {
                while self.decoder.can_collect() < buf.len() && !self.decoder.is_finished() {
                    let wanted = buf.len() - self.decoder.can_collect();
                    self.decoder
                        .decode_blocks(&mut self.source, BlockDecodingStrategy::UptoBytes(wanted))
                        .map_err(io::Error::other)?;
                }
                let n = self.decoder.read(buf)?;
                if n > 0 {
                    return Ok(n);
                }
                self.in_frame = false; // finished and drained
            }
            if self.source.fill_buf()?.is_empty() {
                return Ok(0);
            }
            match self.decoder.init(&mut self.source) {
                Ok(()) => self.in_frame = true,
                Err(FrameDecoderError::ReadFrameHeaderError(ReadFrameHeaderError::SkipFrame {
                    length,
                    ..
                })) => {
                    let skipped =
                        io::copy(&mut (&mut self.source).take(length.into()), &mut io::sink())?;
                    if skipped < u64::from(length) {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "truncated skippable zstd frame",
                        ));
                    }
                }
                Err(e) => return Err(io::Error::other(e)),
            }
        }
    }
}

#[cfg(test)]
#[path = "flatten_tests.rs"]
mod tests;
