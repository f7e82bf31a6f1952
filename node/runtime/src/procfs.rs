//! What /proc says about a process: identity (pid + start time, so a recycled pid is never
//! mistaken for a VM) and command line (so the runtime only ever signals its own Firecrackers).

use std::path::{Path, PathBuf};

/// Start time of `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat), and whether it
/// is a zombie. None when the process does not exist.
fn stat(pid: i32) -> Option<(u64, char)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // comm (field 2) may hold spaces and parentheses: fields resume after the last ')'.
    let rest = &text[text.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); field 22 is index 19.
    let state = fields.first()?.chars().next()?;
    let start = fields.get(19)?.parse().ok()?;
    Some((start, state))
}

pub fn start_time(pid: i32) -> Option<u64> {
    stat(pid).map(|(s, _)| s)
}

/// The process `pid` that started at `start_time` still runs (a zombie does not).
pub fn is_alive(pid: i32, start_time: u64) -> bool {
    matches!(stat(pid), Some((s, state)) if s == start_time && state != 'Z' && state != 'X')
}

pub fn cmdline(pid: i32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|&c| c == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Every pid in /proc.
pub fn pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The control or device socket a VMM command line names, if any: Firecracker's
/// `--api-sock P`, QEMU's `-qmp unix:P,...`, vhost-device-vsock's `--uds-path P`.
pub fn api_sock_arg(cmdline: &[String]) -> Option<PathBuf> {
    let value = |flag: &str| {
        let i = cmdline.iter().position(|a| a == flag)?;
        cmdline.get(i + 1)
    };
    if let Some(p) = value("--api-sock").or_else(|| value("--uds-path")) {
        return Some(PathBuf::from(p));
    }
    let qmp = value("-qmp")?.strip_prefix("unix:")?;
    Some(PathBuf::from(qmp.split(',').next()?))
}

/// Processes whose VMM socket ([`api_sock_arg`]) lies under `dir`: the VMM processes (and
/// vsock devices) a runtime with that state dir spawned, and no one else's, with their start
/// times.
pub fn firecrackers_under(dir: &Path) -> Vec<(i32, u64, PathBuf)> {
    let me = std::process::id() as i32;
    pids()
        .into_iter()
        .filter(|&pid| pid != me)
        .filter_map(|pid| {
            let sock = api_sock_arg(&cmdline(pid))?;
            if !sock.starts_with(dir) {
                return None;
            }
            let (start, state) = stat(pid)?;
            (state != 'Z').then_some((pid, start, sock))
        })
        .collect()
}

/// VMM processes jailed under `jails` (`<chroot_base>/<exec name>`, one `<id>/root` per VM):
/// those whose root directory is one of those roots (a pivot_root'd process's
/// `/proc/<pid>/root` reads `/`, so they are matched by device and inode) and whose command
/// line names an API socket, with its host path.
pub fn jailed_vmms(jails: &Path) -> Vec<(i32, u64, PathBuf)> {
    use std::os::unix::fs::MetadataExt as _;
    let roots: Vec<((u64, u64), PathBuf)> = std::fs::read_dir(jails)
        .map(|d| {
            d.flatten()
                .map(|e| e.path().join("root"))
                .filter_map(|r| {
                    let m = std::fs::metadata(&r).ok()?;
                    Some(((m.dev(), m.ino()), r))
                })
                .collect()
        })
        .unwrap_or_default();
    if roots.is_empty() {
        return Vec::new();
    }
    pids()
        .into_iter()
        .filter_map(|pid| {
            let m = std::fs::metadata(format!("/proc/{pid}/root")).ok()?;
            let (_, root) = roots.iter().find(|(k, _)| *k == (m.dev(), m.ino()))?;
            let sock = api_sock_arg(&cmdline(pid))?;
            let rel = sock.strip_prefix("/").unwrap_or(&sock);
            let (start, state) = stat(pid)?;
            (state != 'Z').then(|| (pid, start, root.join(rel)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vmm_sockets_of_every_backend_are_found_on_the_command_line() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            api_sock_arg(&args(&[
                "firecracker",
                "--api-sock",
                "/s/vms/a/api.sock",
                "--id",
                "a"
            ])),
            Some(PathBuf::from("/s/vms/a/api.sock"))
        );
        assert_eq!(
            api_sock_arg(&args(&[
                "qemu",
                "-m",
                "1G",
                "-qmp",
                "unix:/s/vms/a/api.sock,server=on,wait=off"
            ])),
            Some(PathBuf::from("/s/vms/a/api.sock"))
        );
        assert_eq!(
            api_sock_arg(&args(&[
                "vhost-device-vsock",
                "--socket",
                "/s/v",
                "--uds-path",
                "/s/vms/a/vsock.sock"
            ])),
            Some(PathBuf::from("/s/vms/a/vsock.sock"))
        );
        assert_eq!(
            api_sock_arg(&args(&["qemu", "-qmp", "tcp:1.2.3.4:5"])),
            None
        );
        assert_eq!(api_sock_arg(&args(&["sleep", "10"])), None);
    }

    #[test]
    fn own_process_identity() {
        let me = std::process::id() as i32;
        let start = start_time(me).expect("own stat");
        assert!(is_alive(me, start));
        assert!(
            !is_alive(me, start + 1),
            "another start time is another process"
        );
        assert!(!cmdline(me).is_empty());
    }

    #[test]
    fn api_sock_argument() {
        let args: Vec<String> = [
            "firecracker",
            "--id",
            "a",
            "--api-sock",
            "/s/vms/a/api.sock",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            api_sock_arg(&args),
            Some(PathBuf::from("/s/vms/a/api.sock"))
        );
        assert_eq!(api_sock_arg(&args[..4]), None);
    }
}
