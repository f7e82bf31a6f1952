//! The serial log cap. The VMM appends the guest console to `serial.log` (O_APPEND, a file the
//! VMM holds open and the runtime does not sit in front of, so VMs outlive the runtime); the
//! runtime checks it periodically and, past half the cap, moves its last half-cap bytes to
//! `serial.log.1` and truncates it: the appending writer carries on at offset 0. The two files
//! together stay under the cap (plus what a guest writes between two checks), and the newest
//! bytes, the ones failure reasons quote, are always kept.

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

/// The older half of a capped serial log.
pub fn rotated(log: &Path) -> PathBuf {
    let mut name = log.file_name().unwrap_or_default().to_os_string();
    name.push(".1");
    log.with_file_name(name)
}

fn last_bytes(path: &Path, n: u64) -> std::io::Result<Vec<u8>> {
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(n)))?;
    let mut buf = Vec::new();
    f.take(n).read_to_end(&mut buf)?;
    Ok(buf)
}

/// Rotate `log` when it holds more than `cap / 2` bytes; returns whether it did. A missing log
/// is nothing to do.
pub fn enforce(log: &Path, cap: u64) -> std::io::Result<bool> {
    let half = cap / 2;
    let len = match std::fs::metadata(log) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    if len <= half {
        return Ok(false);
    }
    let keep = last_bytes(log, half)?;
    let old = rotated(log);
    let mut tmp_name = old.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp = old.with_file_name(tmp_name);
    // The rotated half keeps the log's owner and mode: a confined VM's console is its own, 0600,
    // and a root-owned copy would be readable by imp-agent (uid 0) as its owner.
    let meta = std::fs::metadata(log)?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    std::os::unix::fs::fchown(&file, Some(meta.uid()), Some(meta.gid()))?;
    file.set_permissions(std::fs::Permissions::from_mode(meta.mode() & 0o777))?;
    file.write_all(&keep)?;
    std::fs::rename(&tmp, &old)?;
    // Bytes appended since the read above are lost: at most one check interval's worth of a
    // flooding guest, never a quiet guest's last words (it would be under the threshold).
    std::fs::OpenOptions::new()
        .write(true)
        .open(log)?
        .set_len(0)?;
    Ok(true)
}

/// Bytes of a log quoted in failure reasons.
pub const TAIL_BYTES: u64 = 2048;

/// The last [`TAIL_BYTES`] of a log (the console, or a VMM's own), lossily decoded and
/// trimmed; "" when there is none.
pub fn tail(log: &Path) -> String {
    last(log, TAIL_BYTES)
}

/// The last `n` bytes of the console (the rotated half, then the current file), lossily
/// decoded and trimmed; "" when there is none.
pub fn last(log: &Path, n: u64) -> String {
    let current = last_bytes(log, n).unwrap_or_default();
    let mut out = if (current.len() as u64) < n {
        last_bytes(&rotated(log), n - current.len() as u64).unwrap_or_default()
    } else {
        Vec::new()
    };
    out.extend_from_slice(&current);
    String::from_utf8_lossy(&out).trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_logs_are_left_alone() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("serial.log");
        assert!(!enforce(&log, 100).unwrap(), "missing log");
        std::fs::write(&log, b"booting\n").unwrap();
        assert!(!enforce(&log, 100).unwrap());
        assert_eq!(std::fs::read(&log).unwrap(), b"booting\n");
        assert!(!rotated(&log).exists());
    }

    #[test]
    fn a_full_log_keeps_its_newest_half_cap_and_the_tail_spans_both_files() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("serial.log");
        let text: Vec<u8> = (0..200u8).map(|i| b'a' + i % 26).collect();
        std::fs::write(&log, &text).unwrap();
        assert!(enforce(&log, 100).unwrap());
        assert_eq!(std::fs::read(rotated(&log)).unwrap(), &text[150..]);
        assert_eq!(std::fs::metadata(&log).unwrap().len(), 0);
        std::fs::OpenOptions::new()
            .append(true)
            .open(&log)
            .unwrap()
            .write_all(b"Kernel panic")
            .unwrap();
        let t = last(&log, 20);
        assert!(t.ends_with("Kernel panic"), "{t}");
        assert_eq!(t.len(), 20);
        assert_eq!(&t.as_bytes()[..8], &text[192..]);
    }

    /// A confined VM's console (its uid, 0600) rotates into a file of the same owner and mode, never a
    /// root-owned one imp-agent (uid 0) could read.
    #[test]
    fn the_rotated_half_keeps_the_logs_owner_and_mode() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("serial.log");
        std::fs::write(&log, [b'x'; 200]).unwrap();
        std::fs::set_permissions(&log, std::fs::Permissions::from_mode(0o600)).unwrap();
        let owner = if nix::unistd::geteuid().is_root() {
            std::os::unix::fs::chown(&log, Some(4242), Some(4243)).unwrap();
            (4242, 4243)
        } else {
            let m = std::fs::metadata(&log).unwrap();
            (m.uid(), m.gid())
        };
        assert!(enforce(&log, 100).unwrap());
        let m = std::fs::metadata(rotated(&log)).unwrap();
        assert_eq!(
            (m.uid(), m.gid(), m.mode() & 0o777),
            (owner.0, owner.1, 0o600)
        );
    }

    /// An O_APPEND writer that never stops (a guest running `yes > /dev/ttyS0`): the files stay
    /// bounded and the newest bytes are the writer's.
    #[test]
    fn a_flooding_writer_stays_under_the_cap() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("serial.log");
        let mut writer = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("exec yes flood >> {}", log.display()))
            .spawn()
            .unwrap();
        let cap = 1 << 20;
        let mut rotations = 0;
        for _ in 0..50 {
            std::thread::sleep(std::time::Duration::from_millis(20));
            rotations += usize::from(enforce(&log, cap).unwrap());
            let old = std::fs::metadata(rotated(&log))
                .map(|m| m.len())
                .unwrap_or(0);
            assert!(old <= cap / 2, "rotated half holds {old} bytes");
        }
        let _ = writer.kill();
        let _ = writer.wait();
        assert!(rotations > 0, "the writer never filled half the cap");
        enforce(&log, cap).unwrap();
        let total = std::fs::metadata(&log).unwrap().len()
            + std::fs::metadata(rotated(&log)).unwrap().len();
        assert!(total <= cap, "{total} bytes on disk with a cap of {cap}");
        assert!(last(&log, 64).contains("flood"));
    }
}
