//! Flattener tests. They run as root (here and in CI), so ownership, device nodes and anything
//! a broken extractor could do to the host are real; every hostile case checks that a sentinel
//! tree beside the work directory is unchanged afterwards.

use super::*;
use imp_testkit::tarball::{RawEntry, TarBuilder, gzip};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use tempfile::TempDir;

const LAYER: &str = "sha256:ab12cd34";

/// `base/work/root` is the work directory; `base/outside` is the host we must not touch.
struct Fixture {
    base: TempDir,
}

impl Fixture {
    fn new() -> Self {
        let base = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(base.path().join("work/root")).unwrap();
        std::fs::create_dir(base.path().join("outside")).unwrap();
        std::fs::write(base.path().join("outside/secret.txt"), "host secret").unwrap();
        std::fs::write(base.path().join("outside/victim"), "keep me").unwrap();
        Fixture { base }
    }

    fn root(&self) -> PathBuf {
        self.base.path().join("work/root")
    }

    fn flattener(&self, limits: Limits) -> Flattener {
        Flattener::new(&self.root(), limits).unwrap()
    }

    /// Everything under `base` except the work directory's contents: path, type, mode, content.
    fn host_snapshot(&self) -> Vec<String> {
        let root = self.root();
        listing(self.base.path(), &|p| p == root)
    }
}

/// A sorted listing of `dir` (relative paths): type, then content or link target; `skip`
/// prunes subtrees.
fn listing(dir: &Path, skip: &dyn Fn(&Path) -> bool) -> Vec<String> {
    fn walk(base: &Path, dir: &Path, skip: &dyn Fn(&Path) -> bool, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let rel = path.strip_prefix(base).unwrap().display().to_string();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let ft = meta.file_type();
            if ft.is_dir() {
                out.push(format!("{rel} dir"));
                if !skip(&path) {
                    walk(base, &path, skip, out);
                }
            } else if ft.is_symlink() {
                let target = std::fs::read_link(&path).unwrap();
                out.push(format!("{rel} symlink {}", target.display()));
            } else if ft.is_file() {
                let content = std::fs::read_to_string(&path).unwrap();
                out.push(format!("{rel} file {content}"));
            } else {
                out.push(format!("{rel} special"));
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, skip, &mut out);
    out.sort();
    out
}

fn tree(root: &Path) -> Vec<String> {
    listing(root, &|_| false)
}

fn apply(f: &mut Flattener, tar: TarBuilder) -> LayerStats {
    f.apply_layer(LAYER, &tar.into_tar()[..], Compression::None)
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Hostile layers
// ---------------------------------------------------------------------------------------------

struct Hostile {
    name: &'static str,
    blob: Vec<u8>,
    compression: Compression,
    limits: Limits,
    /// The entry the error must name.
    entry: &'static str,
    expect: fn(&FlattenError) -> bool,
    /// Host paths that must not exist afterwards.
    absent: &'static [&'static str],
}

fn hostile(
    name: &'static str,
    tar: TarBuilder,
    entry: &'static str,
    expect: fn(&FlattenError) -> bool,
) -> Hostile {
    Hostile {
        name,
        blob: tar.into_tar(),
        compression: Compression::None,
        limits: Limits::default(),
        entry,
        expect,
        absent: &[],
    }
}

fn hostile_corpus() -> Vec<Hostile> {
    use FlattenError as E;
    let t = TarBuilder::new;
    let mut cases = vec![
        hostile(
            "dotdot file",
            t().file("../evil", b"x", 0o644),
            "../evil",
            |e| matches!(e, E::PathTraversal { .. }),
        ),
        hostile(
            "deep dotdot",
            t().dir("a", 0o755).file("a/../../x", b"x", 0o644),
            "a/../../x",
            |e| matches!(e, E::PathTraversal { .. }),
        ),
        Hostile {
            absent: &["/etc/imp-flatten-evil"],
            ..hostile(
                "absolute name",
                t().file("/etc/imp-flatten-evil", b"x", 0o644),
                "/etc/imp-flatten-evil",
                |e| matches!(e, E::AbsolutePath { .. }),
            )
        },
        Hostile {
            absent: &["/etc/imp-flatten-evil"],
            ..hostile(
                "write through absolute symlink",
                t().symlink("etc", "/etc")
                    .file("etc/imp-flatten-evil", b"x", 0o644),
                "etc/imp-flatten-evil",
                |e| {
                    matches!(e, E::AbsoluteSymlinkInPath { through, target, .. }
                        if through == "etc" && target == "/etc")
                },
            )
        },
        hostile(
            "write through escaping relative symlink",
            t().symlink("esc", "../../outside")
                .file("esc/pwned", b"x", 0o644),
            "esc/pwned",
            |e| matches!(e, E::SymlinkEscape { through, .. } if through == "esc"),
        ),
        hostile(
            "write through escaping symlink chain",
            t().symlink("a", "b")
                .symlink("b", "../..")
                .file("a/outside/pwned", b"x", 0o644),
            "a/outside/pwned",
            |e| matches!(e, E::SymlinkEscape { through, .. } if through == "b"),
        ),
        hostile(
            "mkdir through escaping symlink",
            t().symlink("esc", "../../outside").dir("esc/newdir", 0o755),
            "esc/newdir",
            |e| matches!(e, E::SymlinkEscape { .. }),
        ),
        hostile(
            "symlink loop",
            t().symlink("l1", "l2")
                .symlink("l2", "l1")
                .file("l1/x", b"x", 0o644),
            "l1/x",
            |e| matches!(e, E::SymlinkLoop { .. }),
        ),
        hostile(
            "hardlink to absolute target",
            t().hardlink("passwd", "/etc/passwd"),
            "passwd",
            |e| matches!(e, E::HardlinkEscape { target, .. } if target == "/etc/passwd"),
        ),
        hostile(
            "hardlink with dotdot target",
            t().hardlink("secret", "../../outside/secret.txt"),
            "secret",
            |e| matches!(e, E::HardlinkEscape { .. }),
        ),
        hostile(
            "hardlink through escaping symlink",
            t().symlink("esc", "../../outside")
                .hardlink("secret", "esc/secret.txt"),
            "secret",
            |e| matches!(e, E::HardlinkEscape { .. }),
        ),
        hostile(
            "hardlink through absolute symlink",
            t().symlink("etc", "/etc").hardlink("passwd", "etc/passwd"),
            "passwd",
            |e| matches!(e, E::HardlinkEscape { .. }),
        ),
        hostile(
            "hardlink to missing target",
            t().hardlink("link", "no/such/file"),
            "link",
            |e| matches!(e, E::HardlinkTargetMissing { target, .. } if target == "no/such/file"),
        ),
        hostile(
            "whiteout above the root",
            t().whiteout("../victim"),
            "../.wh.victim",
            |e| matches!(e, E::PathTraversal { .. }),
        ),
        hostile(
            "whiteout of the directory itself",
            t().file(".wh..", b"", 0o644),
            ".wh..",
            |e| matches!(e, E::PathTraversal { .. }),
        ),
        hostile(
            "whiteout of dotdot",
            t().file("etc/.wh...", b"", 0o644),
            "etc/.wh...",
            |e| matches!(e, E::PathTraversal { .. }),
        ),
        hostile(
            "whiteout of nothing",
            t().file("dir/.wh.", b"", 0o644),
            "dir/.wh.",
            |e| matches!(e, E::InvalidWhiteout { .. }),
        ),
        hostile(
            "block device",
            t().blockdev("dev/sda", 8, 0),
            "dev/sda",
            |e| {
                matches!(
                    e,
                    E::DeviceNotAllowed {
                        kind: "block",
                        major: 8,
                        minor: 0,
                        ..
                    }
                )
            },
        ),
        hostile("dev/mem", t().chardev("dev/mem", 1, 1), "dev/mem", |e| {
            matches!(
                e,
                E::DeviceNotAllowed {
                    kind: "character",
                    major: 1,
                    minor: 1,
                    ..
                }
            )
        }),
        hostile(
            "unknown entry type",
            t().raw(RawEntry {
                name: b"weird".to_vec(),
                kind: b'Z',
                ..RawEntry::default()
            }),
            "weird",
            |e| matches!(e, E::UnsupportedEntryType { kind, .. } if kind == "type byte 'Z'"),
        ),
        hostile(
            "PAX path with dotdot",
            t().raw(RawEntry {
                name: b"innocent".to_vec(),
                pax: vec![("path".into(), b"../pax-evil".to_vec())],
                data: b"x".to_vec(),
                ..RawEntry::default()
            }),
            "../pax-evil",
            |e| matches!(e, E::PathTraversal { .. }),
        ),
        hostile(
            "file named as the root",
            t().file("./", b"x", 0o644),
            "./",
            |e| matches!(e, E::RootReplaced { .. }),
        ),
        Hostile {
            limits: Limits {
                max_entries: 3,
                ..Limits::default()
            },
            ..hostile(
                "too many entries",
                t().file("f0", b"", 0o644)
                    .file("f1", b"", 0o644)
                    .file("f2", b"", 0o644)
                    .file("f3", b"", 0o644),
                "f3",
                |e| matches!(e, E::TooManyEntries { limit: 3, .. }),
            )
        },
    ];
    // A gzip bomb: 8 MiB of zeros compress to a few KiB; the limit is 1 MiB. The header even
    // tells the truth here, so only counting decompressed bytes stops it.
    let bomb = TarBuilder::new().file("bomb", &vec![0u8; 8 << 20], 0o644);
    let bomb_gz = bomb.into_gzip();
    assert!(bomb_gz.len() < 64 * 1024, "{}", bomb_gz.len());
    cases.push(Hostile {
        name: "gzip bomb",
        blob: bomb_gz,
        compression: Compression::Gzip,
        limits: Limits {
            max_unpacked_bytes: 1 << 20,
            ..Limits::default()
        },
        entry: "bomb",
        expect: |e| matches!(e, FlattenError::TooLarge { limit, .. } if *limit == 1 << 20),
        absent: &[],
    });
    cases
}

#[test]
fn hostile_layers_are_refused_and_the_host_is_untouched() {
    let cases = hostile_corpus();
    assert!(cases.len() >= 12);
    for case in cases {
        let fx = Fixture::new();
        let before = fx.host_snapshot();
        let mut f = fx.flattener(case.limits);
        let err = f
            .apply_layer(LAYER, &case.blob[..], case.compression)
            .expect_err(case.name);
        assert!(
            (case.expect)(&err),
            "{}: unexpected error {err:?}",
            case.name
        );
        let shown = err.to_string();
        assert!(
            shown.contains(&format!("layer {LAYER}:")),
            "{}: {shown}",
            case.name
        );
        assert!(
            shown.contains(&format!("entry {:?}", case.entry)),
            "{}: {shown}",
            case.name
        );
        assert!(
            matches!(
                err.reason(),
                reason::LAYER_REJECTED | reason::LAYER_TOO_LARGE
            ),
            "{}: {}",
            case.name,
            err.reason()
        );
        assert_eq!(fx.host_snapshot(), before, "{}: host changed", case.name);
        for path in case.absent {
            assert!(
                !Path::new(path).exists(),
                "{}: {path} was created",
                case.name
            );
        }
        assert!(
            std::fs::read_to_string("/etc/passwd")
                .unwrap()
                .contains("root:"),
            "{}",
            case.name
        );
    }
}

#[test]
fn a_symlink_entry_is_replaced_not_written_through() {
    let fx = Fixture::new();
    let before = fx.host_snapshot();
    let mut f = fx.flattener(Limits::default());
    apply(
        &mut f,
        TarBuilder::new()
            .symlink("victim", "../../outside/victim")
            .file("victim", b"layer content", 0o644),
    );
    assert_eq!(fx.host_snapshot(), before);
    assert_eq!(tree(&fx.root()), ["victim file layer content"]);
}

#[test]
fn size_limit_spans_layers_and_errors_say_what_failed() {
    let fx = Fixture::new();
    let layer = TarBuilder::new().file("a", &[7u8; 4096], 0o644).into_tar();
    let mut f = fx.flattener(Limits {
        max_unpacked_bytes: layer.len() as u64 + 1000,
        ..Limits::default()
    });
    let stats = f
        .apply_layer("first", &layer[..], Compression::None)
        .unwrap();
    assert_eq!(f.unpacked_bytes(), stats.unpacked_bytes);
    assert!(stats.unpacked_bytes >= 4096 + 512 && stats.unpacked_bytes <= layer.len() as u64);
    let err = f
        .apply_layer("second", &layer[..], Compression::None)
        .unwrap_err();
    let limit = layer.len() as u64 + 1000;
    assert!(
        matches!(err, FlattenError::TooLarge { limit: l, .. } if l == limit),
        "{err:?}"
    );
    assert_eq!(err.reason(), reason::LAYER_TOO_LARGE);

    let err = f
        .apply_layer("sha256:garbage", &b"not gzip at all"[..], Compression::Gzip)
        .unwrap_err();
    assert!(matches!(err, FlattenError::Decompress { .. }), "{err:?}");
    assert_eq!(err.reason(), reason::LAYER_UNREADABLE);
    assert!(
        err.to_string().starts_with("layer sha256:garbage: "),
        "{err}"
    );

    // A header claiming more content than the stream holds.
    let mut truncated = TarBuilder::new()
        .file("big", &[1u8; 2048], 0o644)
        .into_tar();
    truncated.truncate(1024);
    let fx = Fixture::new();
    let err = fx
        .flattener(Limits::default())
        .apply_layer(LAYER, &truncated[..], Compression::None)
        .unwrap_err();
    assert!(matches!(err, FlattenError::Malformed { .. }), "{err:?}");
    assert!(err.to_string().contains("entry \"big\""), "{err}");
}

#[test]
fn new_refuses_a_non_empty_work_dir() {
    let fx = Fixture::new();
    std::fs::write(fx.root().join("leftover"), "x").unwrap();
    let err = Flattener::new(&fx.root(), Limits::default()).err().unwrap();
    assert!(matches!(err, FlattenError::RootNotEmpty { .. }), "{err:?}");
}

// ---------------------------------------------------------------------------------------------
// Entry semantics
// ---------------------------------------------------------------------------------------------

#[test]
fn allowed_devices_and_fifos_are_created() {
    let fx = Fixture::new();
    let mut f = fx.flattener(Limits::default());
    let mut layer = TarBuilder::new().dir("dev", 0o755);
    for &(major, minor, name) in ALLOWED_CHAR_DEVICES {
        layer = layer.chardev(&format!("dev/{name}"), major, minor);
    }
    apply(&mut f, layer.fifo("run/initctl"));
    for &(major, minor, name) in ALLOWED_CHAR_DEVICES {
        let meta = std::fs::symlink_metadata(fx.root().join("dev").join(name)).unwrap();
        assert!(meta.file_type().is_char_device(), "{name}");
        assert_eq!(meta.rdev(), rustix::fs::makedev(major, minor), "{name}");
        assert_eq!(meta.mode() & 0o7777, 0o666, "{name}");
    }
    let fifo = std::fs::symlink_metadata(fx.root().join("run/initctl")).unwrap();
    assert!(fifo.file_type().is_fifo());
}

#[test]
fn modes_owners_and_mtimes_are_kept() {
    let fx = Fixture::new();
    let mut f = fx.flattener(Limits::default());
    let owned = |name: &str, kind: u8, mode: u32, linkname: &str| RawEntry {
        name: name.into(),
        kind,
        mode,
        uid: 1000,
        gid: 1001,
        mtime: 1_234_567_890,
        linkname: linkname.into(),
        data: if kind == b'0' {
            b"#!/bin/true".to_vec()
        } else {
            Vec::new()
        },
        ..RawEntry::default()
    };
    apply(
        &mut f,
        TarBuilder::new()
            .raw(owned("usr/bin/su", b'0', 0o4755, ""))
            .raw(owned("usr/bin/wall", b'0', 0o2755, ""))
            .raw(owned("home/user", b'5', 0o700, ""))
            .raw(owned("tmp", b'5', 0o1777, ""))
            .raw(owned("home/user/link", b'2', 0o777, "../../usr/bin/su"))
            .raw(RawEntry {
                name: b"precise".to_vec(),
                pax: vec![("mtime".into(), b"1700000000.5".to_vec())],
                ..RawEntry::default()
            }),
    );
    let meta = |p: &str| std::fs::symlink_metadata(fx.root().join(p)).unwrap();
    assert_eq!(meta("usr/bin/su").mode() & 0o7777, 0o4755);
    assert_eq!(meta("usr/bin/wall").mode() & 0o7777, 0o2755);
    assert_eq!(meta("tmp").mode() & 0o7777, 0o1777);
    assert_eq!(meta("home/user").mode() & 0o7777, 0o700);
    for p in ["usr/bin/su", "home/user", "home/user/link"] {
        assert_eq!((meta(p).uid(), meta(p).gid()), (1000, 1001), "{p}");
        assert_eq!(meta(p).mtime(), 1_234_567_890, "{p}");
    }
    assert_eq!(
        (meta("precise").mtime(), meta("precise").mtime_nsec()),
        (1_700_000_000, 500_000_000)
    );
    // Parent dirs the layer did not list are made 0755 root:root.
    assert_eq!(meta("usr").mode() & 0o7777, 0o755);
    assert_eq!((meta("usr").uid(), meta("usr").gid()), (0, 0));
}

#[test]
fn xattrs_user_and_capability_names_only() {
    let fx = Fixture::new();
    let mut f = fx.flattener(Limits::default());
    apply(
        &mut f,
        TarBuilder::new().raw(RawEntry {
            name: b"bin/tool".to_vec(),
            pax: vec![
                ("SCHILY.xattr.user.origin".into(), b"layer".to_vec()),
                ("SCHILY.xattr.trusted.overlay.opaque".into(), b"y".to_vec()),
            ],
            ..RawEntry::default()
        }),
    );
    let path = fx.root().join("bin/tool");
    let mut buf = [0u8; 64];
    let n = rustix::fs::getxattr(&path, "user.origin", &mut buf).unwrap();
    assert_eq!(&buf[..n], b"layer");
    assert_eq!(
        rustix::fs::getxattr(&path, "trusted.overlay.opaque", &mut buf).unwrap_err(),
        Errno::NODATA
    );
}

#[test]
fn in_root_symlinks_are_followed_and_links_are_created_as_written() {
    let fx = Fixture::new();
    let mut f = fx.flattener(Limits::default());
    apply(
        &mut f,
        TarBuilder::new()
            .dir("./usr/bin", 0o755)
            .symlink("./bin", "usr/bin")
            .symlink("etc/alternatives/x", "/nonexistent/absolute")
            .symlink("dangling", "nowhere")
            .file("bin/tool", b"tool", 0o755)
            .file("a", b"shared", 0o644)
            .hardlink("b", "./a")
            .hardlink("bin/tool2", "usr/bin/tool")
            .hardlink("hl-to-symlink", "dangling"),
    );
    let root = fx.root();
    assert_eq!(std::fs::read(root.join("usr/bin/tool")).unwrap(), b"tool");
    assert_eq!(
        std::fs::read_link(root.join("bin")).unwrap(),
        Path::new("usr/bin")
    );
    assert_eq!(
        std::fs::read_link(root.join("etc/alternatives/x")).unwrap(),
        Path::new("/nonexistent/absolute")
    );
    assert_eq!(
        std::fs::read_link(root.join("dangling")).unwrap(),
        Path::new("nowhere")
    );
    let ino = |p: &str| std::fs::symlink_metadata(root.join(p)).unwrap().ino();
    assert_eq!(ino("a"), ino("b"));
    assert_eq!(ino("usr/bin/tool"), ino("usr/bin/tool2"));
    assert_eq!(ino("dangling"), ino("hl-to-symlink"));

    // A later layer may hardlink to what an earlier one left.
    apply(&mut f, TarBuilder::new().hardlink("c", "a"));
    assert_eq!(ino("a"), ino("c"));
    assert_eq!(
        std::fs::symlink_metadata(root.join("a")).unwrap().nlink(),
        3
    );
}

#[test]
fn entries_replace_what_is_there_whatever_its_type() {
    let fx = Fixture::new();
    let mut f = fx.flattener(Limits::default());
    apply(
        &mut f,
        TarBuilder::new()
            .dir("x", 0o755)
            .file("x/child", b"1", 0o644)
            .file("y", b"1", 0o644)
            .symlink("z", "x")
            .dir("keep", 0o700)
            .file("keep/lower", b"1", 0o644),
    );
    apply(
        &mut f,
        TarBuilder::new()
            .file("x", b"now a file", 0o644)
            .dir("y", 0o755)
            .file("y/child", b"2", 0o644)
            .dir("z", 0o755)
            .dir("keep", 0o750),
    );
    assert_eq!(
        tree(&fx.root()),
        [
            "keep dir",
            "keep/lower file 1",
            "x file now a file",
            "y dir",
            "y/child file 2",
            "z dir",
        ]
    );
    let keep = std::fs::metadata(fx.root().join("keep")).unwrap();
    assert_eq!(keep.permissions().mode() & 0o7777, 0o750);
}

#[test]
fn a_read_only_directory_takes_its_children() {
    let fx = Fixture::new();
    let mut f = fx.flattener(Limits::default());
    apply(
        &mut f,
        TarBuilder::new()
            .dir("ro", 0o555)
            .file("ro/f", b"child", 0o444)
            .dir("ro/sub", 0o500)
            .file("ro/sub/g", b"grandchild", 0o444),
    );
    assert_eq!(
        tree(&fx.root()),
        [
            "ro dir",
            "ro/f file child",
            "ro/sub dir",
            "ro/sub/g file grandchild"
        ]
    );
    let meta = std::fs::metadata(fx.root().join("ro")).unwrap();
    assert_eq!(meta.mode() & 0o7777, 0o555);
    // The mtime is the entry's, set after the children were written.
    assert_eq!(meta.mtime(), 1_700_000_000);
    assert_eq!(
        std::fs::metadata(fx.root().join("ro/sub")).unwrap().mode() & 0o7777,
        0o500
    );
}

fn sample_layer() -> Vec<u8> {
    let long = format!("{}/file", "long-directory-name".repeat(8));
    TarBuilder::new()
        .pax_global(&[("comment", b"git commit 0123")])
        .dir("./", 0o755)
        .dir("./etc", 0o755)
        .file("./etc/os-release", b"ID=test", 0o644)
        .file(&long, b"long name", 0o644)
        .symlink("./etc/link", "os-release")
        .into_tar()
}

fn zstd(bytes: &[u8]) -> Vec<u8> {
    ruzstd::encoding::compress_to_vec(bytes, ruzstd::encoding::CompressionLevel::Fastest)
}

#[test]
fn plain_gzip_and_zstd_layers_give_the_same_tree() {
    let tar = sample_layer();
    // Two zstd frames split mid-archive with a skippable frame between them, as parallel
    // compressors and zstd:chunked write.
    let (head, tail) = tar.split_at(700);
    let mut multi_frame = zstd(head);
    multi_frame.extend_from_slice(&0x184D_2A50u32.to_le_bytes());
    multi_frame.extend_from_slice(&4u32.to_le_bytes());
    multi_frame.extend_from_slice(b"meta");
    multi_frame.extend_from_slice(&zstd(tail));

    let blobs = [
        (tar.clone(), Compression::None),
        (gzip(&tar), Compression::Gzip),
        (zstd(&tar), Compression::Zstd),
        (multi_frame, Compression::Zstd),
    ];
    let mut trees = Vec::new();
    for (blob, compression) in blobs {
        let fx = Fixture::new();
        let mut f = fx.flattener(Limits::default());
        let stats = f.apply_layer(LAYER, &blob[..], compression).unwrap();
        assert_eq!(stats.entries, 6, "{compression:?}");
        assert_eq!(stats.whiteouts, 0);
        trees.push(tree(&fx.root()));
    }
    let long_dir = "long-directory-name".repeat(8);
    let expected = vec![
        "etc dir".to_string(),
        "etc/link symlink os-release".into(),
        "etc/os-release file ID=test".into(),
        format!("{long_dir} dir"),
        format!("{long_dir}/file file long name"),
    ];
    for tree in trees {
        assert_eq!(tree, expected);
    }
}

#[test]
fn inject_file_follows_usrmerge_and_replaces() {
    let fx = Fixture::new();
    let mut f = fx.flattener(Limits::default());
    apply(
        &mut f,
        TarBuilder::new()
            .dir("usr/sbin", 0o755)
            .symlink("sbin", "usr/sbin")
            .dir("usr/sbin/imp-guest", 0o755)
            .file("usr/sbin/imp-guest/junk", b"x", 0o644),
    );
    let src = fx.base.path().join("imp-guest-binary");
    std::fs::write(&src, "agent").unwrap();
    f.inject_file("/sbin/imp-guest", &src, 0o755).unwrap();
    f.inject_file("/opt/imp/bin/agent", &src, 0o700).unwrap();
    let root = fx.root();
    assert_eq!(
        std::fs::read(root.join("usr/sbin/imp-guest")).unwrap(),
        b"agent"
    );
    let meta = std::fs::symlink_metadata(root.join("usr/sbin/imp-guest")).unwrap();
    assert!(meta.is_file());
    assert_eq!(
        (meta.mode() & 0o7777, meta.uid(), meta.gid()),
        (0o755, 0, 0)
    );
    assert_eq!(
        std::fs::metadata(root.join("opt/imp")).unwrap().mode() & 0o7777,
        0o755
    );
    assert_eq!(
        std::fs::read(root.join("opt/imp/bin/agent")).unwrap(),
        b"agent"
    );

    // The same rules as layers: no writing through an absolute symlink.
    let fx = Fixture::new();
    let mut f = fx.flattener(Limits::default());
    apply(&mut f, TarBuilder::new().symlink("sbin", "/usr/sbin"));
    let err = f
        .inject_file("/sbin/imp-flatten-test-guest", &src, 0o755)
        .unwrap_err();
    assert!(
        matches!(err, FlattenError::AbsoluteSymlinkInPath { .. }),
        "{err:?}"
    );
    assert!(!Path::new("/usr/sbin/imp-flatten-test-guest").exists());
    let err = f.inject_file("/../x", &src, 0o755).unwrap_err();
    assert!(matches!(err, FlattenError::PathTraversal { .. }), "{err:?}");
}

#[test]
fn ensure_dir_makes_mount_points() {
    let fx = Fixture::new();
    let mut f = fx.flattener(Limits::default());
    apply(
        &mut f,
        TarBuilder::new()
            .dir("tmp", 0o1777)
            .file("run", b"odd", 0o644),
    );
    for (path, mode) in [
        ("/proc", 0o555),
        ("/sys", 0o555),
        ("/dev", 0o755),
        ("/run", 0o755),
        ("/tmp", 0o1777),
    ] {
        f.ensure_dir(path, mode).unwrap();
        let meta = std::fs::symlink_metadata(fx.root().join(&path[1..])).unwrap();
        assert!(meta.is_dir(), "{path}");
        assert_eq!(meta.mode() & 0o7777, mode, "{path}");
    }
}

// ---------------------------------------------------------------------------------------------
// Whiteouts
// ---------------------------------------------------------------------------------------------

#[test]
fn whiteouts_across_three_layers_match_the_reference() {
    let layers = [
        TarBuilder::new()
            .file("a/keep", b"1", 0o644)
            .file("a/gone", b"1", 0o644)
            .file("b/x", b"1", 0o644)
            .file("b/sub/deep", b"1", 0o644)
            .file("c/lower", b"1", 0o644)
            .file("c/nested/lower", b"1", 0o644)
            .file("d/f", b"1", 0o644)
            .file("e", b"1", 0o644)
            .file("f", b"1", 0o644)
            .file("g/lower", b"1", 0o644)
            .file("h/lower", b"1", 0o644)
            .file("h/sub/lower", b"1", 0o644)
            .symlink("s", "a")
            .symlink("s2", "a/keep"),
        TarBuilder::new()
            // lower-layer file
            .whiteout("a/gone")
            // a lower-layer directory with its content
            .whiteout("d")
            // whiteout before this layer recreates the path: the recreation stays
            .whiteout("e")
            .file("e", b"2", 0o644)
            // whiteout after this layer recreated it: still only lower layers lose it
            .file("f", b"2", 0o644)
            .whiteout("f")
            // opaque after this layer's children
            .file("g/new", b"2", 0o644)
            .opaque("g")
            // opaque before this layer's children, including a lower dir it re-adds
            .opaque("h")
            .dir("h/sub", 0o755)
            .file("h/sub/new", b"2", 0o644)
            .file("h/top", b"2", 0o644)
            // opaque with nested lower dirs this layer also carries (marker last)
            .dir("c/nested", 0o755)
            .file("c/nested/mine", b"2", 0o644)
            .opaque("c")
            // a symlink is whited out itself, not what it points to
            .whiteout("s")
            // nothing there: fine, and no directory is created for it
            .whiteout("nothing-here")
            .whiteout("b/sub/nonexistent")
            .whiteout("missing-dir/x"),
        TarBuilder::new()
            // a directory from layer 1
            .whiteout("b")
            // recreated under a path layer 2 removed
            .file("d/again", b"3", 0o644)
            // layer 2's content is lower now
            .whiteout("f")
            .whiteout("g/new")
            .opaque("h/sub"),
    ];
    let fx = Fixture::new();
    let mut f = fx.flattener(Limits::default());
    let mut whiteouts = Vec::new();
    for layer in layers {
        whiteouts.push(apply(&mut f, layer).whiteouts);
    }
    assert_eq!(whiteouts, [0, 11, 4]);
    assert_eq!(
        tree(&fx.root()),
        [
            "a dir",
            "a/keep file 1",
            "c dir",
            "c/nested dir",
            "c/nested/mine file 2",
            "d dir",
            "d/again file 3",
            "e file 2",
            "g dir",
            "h dir",
            "h/sub dir",
            "h/top file 2",
            "s2 symlink a/keep",
        ]
    );
}

#[test]
fn whiteout_names_parse() {
    assert_eq!(whiteout(b".wh..wh..opq"), Some(Whiteout::Opaque));
    assert_eq!(whiteout(b".wh..wh.plnk"), Some(Whiteout::AufsMeta));
    assert_eq!(whiteout(b".wh.foo"), Some(Whiteout::Entry(b"foo")));
    assert_eq!(whiteout(b".wh."), Some(Whiteout::Entry(b"")));
    assert_eq!(whiteout(b"foo.wh.bar"), None);
    assert_eq!(
        normalize(b"./a//b/./c/"),
        Ok(vec![b"a".to_vec(), b"b".to_vec(), b"c".to_vec()])
    );
    assert_eq!(normalize(b"a/b/.."), Err(NameProblem::DotDot));
    assert_eq!(normalize(b"/a"), Err(NameProblem::Absolute));
    assert_eq!(normalize(b"./"), Ok(vec![]));
}

#[test]
fn pax_times_parse() {
    let t = |s: &str| parse_pax_time(s.as_bytes()).map(|t| (t.tv_sec, t.tv_nsec));
    assert_eq!(t("12"), Some((12, 0)));
    assert_eq!(t("12.25"), Some((12, 250_000_000)));
    assert_eq!(t("-1.5"), Some((-2, 500_000_000)));
    assert_eq!(t("1.0000000001"), Some((1, 0)));
    assert_eq!(t("x"), None);
}
