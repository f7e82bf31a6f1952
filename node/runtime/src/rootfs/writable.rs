//! Per-VM writable drives (the overlay upper layer the guest mounts with `imp.overlay=`), made in
//! O(1) whatever the size of the VM's image: one empty ext4 template per drive size is made
//! once, and each VM gets a clone of it — a reflink where the host filesystem supports it,
//! otherwise a sparse copy of the few megabytes of metadata the template holds.

use std::fs::File;
use std::io::ErrorKind;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use rustix::fs::SeekFrom;

#[derive(Debug, thiserror::Error)]
pub enum WritableError {
    #[error("run mkfs.ext4 (Debian package e2fsprogs): {0}")]
    Spawn(std::io::Error),
    #[error("mkfs.ext4 on the writable-drive template {path}: {stderr}")]
    Mkfs { path: PathBuf, stderr: String },
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// How a drive was made from its template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloneMethod {
    Reflink,
    SparseCopy,
}

pub struct WritableDrives {
    templates: PathBuf,
    /// Serialises template creation; clones run concurrently.
    making: Mutex<()>,
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> WritableError {
    let path = path.to_path_buf();
    move |source| WritableError::Io { op, path, source }
}

impl WritableDrives {
    /// Templates live in `templates_dir` (created if missing), one file per size.
    pub fn new(templates_dir: &Path) -> Result<Self, WritableError> {
        std::fs::create_dir_all(templates_dir).map_err(io("create", templates_dir))?;
        Ok(Self {
            templates: templates_dir.to_path_buf(),
            making: Mutex::new(()),
        })
    }

    /// The empty ext4 template for `bytes`, made on first use.
    pub fn template(&self, bytes: u64) -> Result<PathBuf, WritableError> {
        let path = self.templates.join(format!("empty-{bytes}.ext4"));
        let _making = self.making.lock().expect("template lock");
        if path.exists() {
            return Ok(path);
        }
        let tmp = self.templates.join(format!(".empty-{bytes}.ext4.tmp"));
        File::create(&tmp)
            .and_then(|f| f.set_len(bytes))
            .map_err(io("create", &tmp))?;
        // Lazy init: the inode tables are zeroed by the guest kernel in the background, so the
        // template holds only superblocks, bitmaps and the root directory.
        let out = Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0", "-L", "imp-writable"])
            .args([
                "-E",
                "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0",
            ])
            .arg(&tmp)
            .output()
            .map_err(WritableError::Spawn)?;
        if !out.status.success() {
            let _ = std::fs::remove_file(&tmp);
            return Err(WritableError::Mkfs {
                path: path.clone(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            });
        }
        File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(io("fsync", &tmp))?;
        std::fs::rename(&tmp, &path).map_err(io("rename", &tmp))?;
        Ok(path)
    }

    /// Make `dest` (which must not exist) a fresh writable drive of `bytes`.
    pub fn create(&self, dest: &Path, bytes: u64) -> Result<CloneMethod, WritableError> {
        let template = self.template(bytes)?;
        clone_file(&template, dest)
    }

    /// Remove a VM's drive; a missing one is already removed.
    pub fn remove(dest: &Path) -> Result<(), WritableError> {
        match std::fs::remove_file(dest) {
            Err(e) if e.kind() != ErrorKind::NotFound => Err(io("remove", dest)(e)),
            _ => Ok(()),
        }
    }
}

/// Reflink `src` to `dest`, or copy only its data extents (holes stay holes).
pub fn clone_file(src: &Path, dest: &Path) -> Result<CloneMethod, WritableError> {
    let input = File::open(src).map_err(io("open", src))?;
    let len = input.metadata().map_err(io("stat", src))?.size();
    let output = File::options()
        .write(true)
        .create_new(true)
        .open(dest)
        .map_err(io("create", dest))?;
    let result = (|| {
        if rustix::fs::ioctl_ficlone(&output, &input).is_ok() {
            return Ok(CloneMethod::Reflink);
        }
        copy_data_extents(&input, &output, len).map_err(io("copy into", dest))?;
        output.set_len(len).map_err(io("size", dest))?;
        Ok(CloneMethod::SparseCopy)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(dest);
    }
    result
}

fn copy_data_extents(input: &File, output: &File, len: u64) -> std::io::Result<()> {
    let mut pos = 0u64;
    while pos < len {
        let start = match rustix::fs::seek(input, SeekFrom::Data(pos)) {
            Ok(s) => s,
            // ENXIO: no data after `pos`, the rest is a hole.
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let end = rustix::fs::seek(input, SeekFrom::Hole(start))?.min(len);
        let (mut off_in, mut off_out) = (start, start);
        while off_in < end {
            let want = (end - off_in) as usize;
            let n = rustix::fs::copy_file_range(
                input,
                Some(&mut off_in),
                output,
                Some(&mut off_out),
                want,
            )?;
            if n == 0 {
                return Err(std::io::Error::new(
                    ErrorKind::UnexpectedEof,
                    "source shrank while copying",
                ));
            }
        }
        pos = end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    #[test]
    fn clone_preserves_content_and_holes() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("src");
        let mut f = File::create(&src).unwrap();
        f.write_all(b"head").unwrap();
        f.seek(std::io::SeekFrom::Start(64 << 20)).unwrap();
        f.write_all(b"tail").unwrap();
        drop(f);
        let dest = d.path().join("dest");
        clone_file(&src, &dest).unwrap();
        let mut a = Vec::new();
        let mut b = Vec::new();
        File::open(&src).unwrap().read_to_end(&mut a).unwrap();
        File::open(&dest).unwrap().read_to_end(&mut b).unwrap();
        assert!(a == b, "content differs");
        // Sparse: far fewer than 64 MiB allocated.
        let blocks = std::fs::metadata(&dest).unwrap().blocks() * 512;
        assert!(blocks < 4 << 20, "{blocks} bytes allocated");
    }

    #[test]
    fn drives_are_clean_ext4_and_cheap_whatever_their_size() {
        let d = tempfile::tempdir().unwrap();
        let drives = WritableDrives::new(&d.path().join("templates")).unwrap();
        for (i, bytes) in [64u64 << 20, 4 << 30].into_iter().enumerate() {
            let dest = d.path().join(format!("vm{i}.img"));
            drives.create(&dest, bytes).unwrap();
            assert_eq!(std::fs::metadata(&dest).unwrap().len(), bytes);
            let allocated = std::fs::metadata(&dest).unwrap().blocks() * 512;
            assert!(
                allocated < 80 << 20,
                "{allocated} bytes allocated for {bytes}"
            );
            imp_testkit::ext4::assert_fsck_clean(&dest);
            WritableDrives::remove(&dest).unwrap();
            WritableDrives::remove(&dest).unwrap();
            assert!(!dest.exists());
        }
        // One template per size, reused.
        assert_eq!(
            std::fs::read_dir(d.path().join("templates"))
                .unwrap()
                .count(),
            2
        );
        assert!(matches!(
            drives.create(&d.path().join("templates/empty-67108864.ext4"), 64 << 20),
            Err(WritableError::Io { op: "create", .. })
        ));
    }
}
