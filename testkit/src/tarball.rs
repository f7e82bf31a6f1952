//! A raw tar writer for tests that must be able to say anything a hostile layer could say:
//! `..` and absolute names, absolute or escaping link targets, any type byte, any device number,
//! arbitrary PAX records. The `tar` crate's Builder refuses several of these on purpose, so the
//! 512-byte ustar headers are written here by hand (checksum included). Names longer than the
//! ustar fields go into a PAX `path`/`linkpath` record, as real image builders do.

use std::io::Write;

/// Fields of one raw header; `Default` is an empty regular file, mode 0644, owned by root.
#[derive(Debug, Clone)]
pub struct RawEntry {
    pub name: Vec<u8>,
    /// The type byte: b'0' file, b'1' hardlink, b'2' symlink, b'3' char, b'4' block, b'5' dir,
    /// b'6' fifo, b'S' GNU sparse, anything else as given.
    pub kind: u8,
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
    pub mtime: u64,
    pub linkname: Vec<u8>,
    pub devmajor: u32,
    pub devminor: u32,
    /// Extra PAX records (key, value) emitted in an `x` header right before this entry.
    pub pax: Vec<(String, Vec<u8>)>,
    pub data: Vec<u8>,
}

impl Default for RawEntry {
    fn default() -> Self {
        RawEntry {
            name: Vec::new(),
            kind: b'0',
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime: 1_700_000_000,
            linkname: Vec::new(),
            devmajor: 0,
            devminor: 0,
            pax: Vec::new(),
            data: Vec::new(),
        }
    }
}

/// Builds an uncompressed tar stream entry by entry, in the order the methods are called.
#[derive(Debug, Default)]
pub struct TarBuilder {
    out: Vec<u8>,
}

impl TarBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn file(self, path: &str, data: &[u8], mode: u32) -> Self {
        self.raw(RawEntry {
            name: path.into(),
            mode,
            data: data.to_vec(),
            ..RawEntry::default()
        })
    }

    pub fn dir(self, path: &str, mode: u32) -> Self {
        self.raw(RawEntry {
            name: path.into(),
            kind: b'5',
            mode,
            ..RawEntry::default()
        })
    }

    pub fn symlink(self, path: &str, target: &str) -> Self {
        self.raw(RawEntry {
            name: path.into(),
            kind: b'2',
            mode: 0o777,
            linkname: target.into(),
            ..RawEntry::default()
        })
    }

    pub fn hardlink(self, path: &str, target: &str) -> Self {
        self.raw(RawEntry {
            name: path.into(),
            kind: b'1',
            linkname: target.into(),
            ..RawEntry::default()
        })
    }

    pub fn chardev(self, path: &str, major: u32, minor: u32) -> Self {
        self.device(path, b'3', major, minor)
    }

    pub fn blockdev(self, path: &str, major: u32, minor: u32) -> Self {
        self.device(path, b'4', major, minor)
    }

    fn device(self, path: &str, kind: u8, devmajor: u32, devminor: u32) -> Self {
        self.raw(RawEntry {
            name: path.into(),
            kind,
            mode: 0o666,
            devmajor,
            devminor,
            ..RawEntry::default()
        })
    }

    pub fn fifo(self, path: &str) -> Self {
        self.raw(RawEntry {
            name: path.into(),
            kind: b'6',
            ..RawEntry::default()
        })
    }

    /// The OCI whiteout for `path`: an empty file `dir/.wh.name`.
    pub fn whiteout(self, path: &str) -> Self {
        let (dir, name) = match path.rfind('/') {
            Some(i) => (&path[..=i], &path[i + 1..]),
            None => ("", path),
        };
        self.file(&format!("{dir}.wh.{name}"), b"", 0o644)
    }

    /// The OCI opaque marker for `dir` (`""` for the image root).
    pub fn opaque(self, dir: &str) -> Self {
        let dir = dir.trim_end_matches('/');
        let name = if dir.is_empty() {
            ".wh..wh..opq".to_string()
        } else {
            format!("{dir}/.wh..wh..opq")
        };
        self.file(&name, b"", 0o644)
    }

    /// A PAX global header (`g`), which extractors ignore.
    pub fn pax_global(self, records: &[(&str, &[u8])]) -> Self {
        let body = pax_body(records.iter().map(|(k, v)| (k.to_string(), v.to_vec())));
        self.raw_header_only(b"pax_global_header", b'g', &body)
    }

    /// Any entry, exactly as described (names and link names are not checked at all).
    pub fn raw(mut self, entry: RawEntry) -> Self {
        let mut pax = entry.pax.clone();
        let name = if entry.name.len() > 100 {
            pax.push(("path".into(), entry.name.clone()));
            entry.name[..100].to_vec()
        } else {
            entry.name.clone()
        };
        let linkname = if entry.linkname.len() > 100 {
            pax.push(("linkpath".into(), entry.linkname.clone()));
            entry.linkname[..100].to_vec()
        } else {
            entry.linkname.clone()
        };
        if !pax.is_empty() {
            let body = pax_body(pax.into_iter());
            self = self.raw_header_only(b"PaxHeaders/entry", b'x', &body);
        }
        let header = ustar_header(&name, &linkname, &entry, entry.data.len() as u64);
        self.out.extend_from_slice(&header);
        self.push_data(&entry.data);
        self
    }

    fn raw_header_only(mut self, name: &[u8], kind: u8, body: &[u8]) -> Self {
        let entry = RawEntry {
            kind,
            ..RawEntry::default()
        };
        let header = ustar_header(name, b"", &entry, body.len() as u64);
        self.out.extend_from_slice(&header);
        self.push_data(body);
        self
    }

    fn push_data(&mut self, data: &[u8]) {
        self.out.extend_from_slice(data);
        let pad = (512 - data.len() % 512) % 512;
        self.out.extend(std::iter::repeat_n(0u8, pad));
    }

    /// The tar stream with its end-of-archive marker (two zero blocks).
    pub fn into_tar(mut self) -> Vec<u8> {
        self.out.extend(std::iter::repeat_n(0u8, 1024));
        self.out
    }

    pub fn into_gzip(self) -> Vec<u8> {
        gzip(&self.into_tar())
    }

    pub fn into_zstd(self) -> Vec<u8> {
        zstd(&self.into_tar())
    }
}

/// Gzip any bytes (e.g. a hand-made tar, or a bomb of zeros).
pub fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(bytes).expect("writing to a Vec");
    encoder.finish().expect("writing to a Vec")
}

/// Zstandard-compress any bytes with the `zstd` tool (Debian package `zstd`): the workspace only
/// carries a pure-Rust decoder, and the layers a registry serves come from real encoders anyway.
pub fn zstd(bytes: &[u8]) -> Vec<u8> {
    zstd_tool(&["-q", "-c", "-3"], bytes)
}

/// Undo [`zstd`], with the same tool.
pub fn unzstd(bytes: &[u8]) -> Vec<u8> {
    zstd_tool(&["-q", "-d", "-c"], bytes)
}

fn zstd_tool(args: &[&str], input: &[u8]) -> Vec<u8> {
    use std::process::{Command, Stdio};
    let mut child = Command::new("zstd")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run zstd (Debian package zstd)");
    let mut stdin = child.stdin.take().expect("piped stdin");
    let input = input.to_vec();
    // Fed from a thread: zstd writes while it reads, and a full stdout pipe would block it.
    let feeder = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().expect("zstd output");
    feeder.join().expect("feeder").expect("feed zstd");
    assert!(out.status.success(), "zstd {args:?} failed: {out:?}");
    out.stdout
}

/// PAX records: `"<len> <key>=<value>\n"` where `<len>` counts the whole record, itself included.
fn pax_body(records: impl Iterator<Item = (String, Vec<u8>)>) -> Vec<u8> {
    let mut body = Vec::new();
    for (key, value) in records {
        let rest = key.len() + value.len() + 3; // ' ', '=', '\n'
        let mut len = rest + 1;
        while len != rest + len.to_string().len() {
            len = rest + len.to_string().len();
        }
        body.extend_from_slice(format!("{len} {key}=").as_bytes());
        body.extend_from_slice(&value);
        body.push(b'\n');
    }
    body
}

fn ustar_header(name: &[u8], linkname: &[u8], entry: &RawEntry, size: u64) -> [u8; 512] {
    let mut h = [0u8; 512];
    h[..name.len()].copy_from_slice(name);
    octal(&mut h[100..108], u64::from(entry.mode));
    octal(&mut h[108..116], entry.uid);
    octal(&mut h[116..124], entry.gid);
    octal(&mut h[124..136], size);
    octal(&mut h[136..148], entry.mtime);
    h[156] = entry.kind;
    h[157..157 + linkname.len()].copy_from_slice(linkname);
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[265..269].copy_from_slice(b"root");
    h[297..301].copy_from_slice(b"root");
    octal(&mut h[329..337], u64::from(entry.devmajor));
    octal(&mut h[337..345], u64::from(entry.devminor));
    // The checksum is computed with its own field read as eight spaces.
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    h
}

/// Zero-padded octal, NUL-terminated, filling the field.
fn octal(field: &mut [u8], value: u64) {
    let digits = field.len() - 1;
    let text = format!("{value:0digits$o}");
    assert!(
        text.len() == digits,
        "{value} does not fit a {digits}-digit octal field"
    );
    field[..digits].copy_from_slice(text.as_bytes());
    field[digits] = 0;
}
