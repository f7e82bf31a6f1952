//! Real VMs without Firecracker: QEMU (software emulation, no /dev/kvm needed) boots a
//! distribution kernel with an initrd, and vhost-device-vsock gives the host the same
//! hybrid-vsock socket Firecracker does, so imp-guest, the protocol and the host client run for
//! real (ARCHITECTURE §8).
//!
//! Runs when IMP_GUEST_STATIC_BIN (from guest/check-static.sh) is set and qemu-system-x86_64,
//! vhost-device-vsock, a static /bin/busybox and a kernel (IMP_QEMU_KERNEL, else the first
//! /boot/vmlinuz-*) with its /lib/modules are present; [`setup_or_skip`] says what it skipped,
//! or fails under IMP_REQUIRE_QEMU=1. guest/vm-test.sh sets all of this up.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use imp_guest::host::{self, HostClient};

/// The modules a distribution kernel needs for virtio drives, overlayfs and vsock under QEMU, in
/// load order.
pub const MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_pci_modern_dev",
    "virtio_pci_legacy_dev",
    "virtio_pci",
    "virtio_blk",
    "overlay",
    "vsock",
    "vmw_vsock_virtio_transport_common",
    "vmw_vsock_virtio_transport",
];

/// A child process killed and reaped on drop.
pub struct Kill(pub Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// No NEEDED entries in the ELF dynamic section.
pub fn is_static(bin: &Path) -> bool {
    Command::new("readelf")
        .arg("-d")
        .arg(bin)
        .output()
        .is_ok_and(|o| {
            o.status.success() && !String::from_utf8_lossy(&o.stdout).contains("(NEEDED)")
        })
}

/// Everything a QEMU boot needs, found on this machine.
#[derive(Debug, Clone)]
pub struct Setup {
    /// The static imp-guest (IMP_GUEST_STATIC_BIN).
    pub guest_bin: PathBuf,
    pub qemu: PathBuf,
    pub vhost: PathBuf,
    pub kernel: PathBuf,
    pub kernel_version: String,
    /// [`MODULES`]' files for the kernel, in the same order.
    pub modules: Vec<PathBuf>,
}

/// What this machine has for the QEMU path, or why it cannot run.
pub fn detect() -> Result<Setup, String> {
    let guest_bin = PathBuf::from(
        std::env::var("IMP_GUEST_STATIC_BIN").map_err(|_| "IMP_GUEST_STATIC_BIN is not set")?,
    );
    detect_with(guest_bin)
}

/// [`detect`] with the static imp-guest the caller built.
pub fn detect_with(guest_bin: PathBuf) -> Result<Setup, String> {
    let qemu = which("qemu-system-x86_64").ok_or("qemu-system-x86_64 not in PATH")?;
    let vhost = which("vhost-device-vsock").ok_or("vhost-device-vsock not in PATH")?;
    if !is_static(Path::new("/bin/busybox")) {
        return Err("no static /bin/busybox (Debian: busybox-static)".into());
    }
    let kernel = match std::env::var("IMP_QEMU_KERNEL") {
        Ok(k) => PathBuf::from(k),
        Err(_) => std::fs::read_dir("/boot")
            .map_err(|e| format!("/boot: {e}"))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
            })
            .min()
            .ok_or("no /boot/vmlinuz-*")?,
    };
    let version = kernel
        .file_name()
        .and_then(|n| n.to_str()?.strip_prefix("vmlinuz-"))
        .ok_or("kernel file name is not vmlinuz-<version>")?
        .to_owned();
    let mut modules = Vec::new();
    for m in MODULES {
        let out = Command::new("modinfo")
            .args(["-k", &version, "-F", "filename", m])
            .output()
            .map_err(|e| format!("modinfo: {e}"))?;
        let path = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if !out.status.success() || !path.ends_with(".ko") {
            return Err(format!(
                "module {m} for {version} not found (or compressed/built in: {path:?})"
            ));
        }
        modules.push(PathBuf::from(path));
    }
    Ok(Setup {
        guest_bin,
        qemu,
        vhost,
        kernel,
        kernel_version: version,
        modules,
    })
}

/// [`detect`], or `None` after printing why the QEMU path is skipped; under IMP_REQUIRE_QEMU=1
/// (guest/vm-test.sh) a missing piece is a failure instead.
pub fn setup_or_skip() -> Option<Setup> {
    match detect() {
        Ok(s) => Some(s),
        Err(why) => {
            crate::skip::skip_or_fail("IMP_REQUIRE_QEMU", "the QEMU real-VM path", &why);
            None
        }
    }
}

/// images/initrd/build.sh: imp-guest as /init, the modules and their load order, gzip. Boots
/// with `imp.lower=/dev/vda imp.overlay=/dev/vdb`.
pub fn scripted_initrd(s: &Setup, out: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../images/initrd/build.sh");
    let status = Command::new(&script)
        .arg("--guest")
        .arg(&s.guest_bin)
        .arg("--out")
        .arg(out)
        .args(["--kernel-version", &s.kernel_version, "--gzip"])
        .status()
        .unwrap();
    assert!(status.success(), "{} failed", script.display());
    println!(
        "scripted initrd: {} bytes",
        std::fs::metadata(out).unwrap().len()
    );
}

/// A virtio drive; the first is /dev/vda, the second /dev/vdb, ...
#[derive(Debug, Clone)]
pub struct Drive {
    pub path: PathBuf,
    pub read_only: bool,
}

impl Drive {
    pub fn read_only(path: impl Into<PathBuf>) -> Self {
        Drive {
            path: path.into(),
            read_only: true,
        }
    }

    pub fn writable(path: impl Into<PathBuf>) -> Self {
        Drive {
            path: path.into(),
            read_only: false,
        }
    }
}

/// One running VM: the vhost-user vsock device and QEMU, both killed on drop, and the files the
/// test reads (console, QEMU's stderr, the host side of the hybrid vsock).
pub struct Vm {
    /// vhost.sock, vm.vsock, console.log, qemu.log, vhost.log.
    pub dir: tempfile::TempDir,
    pub uds: PathBuf,
    pub console: PathBuf,
    pub started: std::time::Instant,
    /// The guest's announcement listener (`<uds>_<READY_VSOCK_PORT>`), bound before QEMU
    /// starts; the first [`Vm::connect`] waits on it, as imp-runtime does.
    announcements: std::sync::Mutex<Option<host::Announcements>>,
    // Field order = drop order: QEMU before its vsock device.
    qemu: Kill,
    _vhost: Kill,
}

impl Vm {
    /// Start vhost-device-vsock and QEMU with `kernel`, `initrd`, the drives in order and
    /// `console=ttyS0 panic=-1 <append>`. Returns once QEMU is spawned; [`Vm::connect`] waits
    /// for the guest.
    pub fn start(s: &Setup, initrd: &Path, drives: &[Drive], append: &str) -> Vm {
        let dir = tempfile::tempdir().unwrap();
        let started = std::time::Instant::now();
        let vhost_sock = dir.path().join("vhost.sock");
        let uds = dir.path().join("vm.vsock");
        let vhost = Kill(
            Command::new(&s.vhost)
                .args(["--guest-cid", "3", "--socket"])
                .arg(&vhost_sock)
                .arg("--uds-path")
                .arg(&uds)
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.path().join("vhost.log")).unwrap())
                .spawn()
                .unwrap(),
        );
        // Fine steps: the boot bench times this helper's boot against imp-runtime's (up to 5 s).
        for _ in 0..2500 {
            if vhost_sock.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let announcements = host::Announcements::bind(&uds).ok();
        let console = dir.path().join("console.log");
        let mut cmd = Command::new(&s.qemu);
        // TCG: works without /dev/kvm (CI containers), a few seconds per boot.
        cmd.args(["-accel", "tcg", "-m", "512", "-display", "none"])
            .args(["-no-reboot", "-nodefaults"])
            // vhost-user needs guest memory the device process can map.
            .args(["-object", "memory-backend-memfd,id=mem0,size=512M,share=on"])
            .args(["-machine", "pc,memory-backend=mem0"])
            .arg("-kernel")
            .arg(&s.kernel)
            .arg("-initrd")
            .arg(initrd)
            .arg("-append")
            .arg(format!("console=ttyS0 panic=-1 {append}"));
        for d in drives {
            cmd.arg("-drive").arg(format!(
                "file={},format=raw,if=virtio{}",
                d.path.display(),
                if d.read_only { ",readonly=on" } else { "" }
            ));
        }
        let qemu = Kill(
            cmd.arg("-chardev")
                .arg(format!("socket,id=vs0,path={}", vhost_sock.display()))
                .args(["-device", "vhost-user-vsock-pci,chardev=vs0"])
                .arg("-serial")
                .arg(format!("file:{}", console.display()))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.path().join("qemu.log")).unwrap())
                .spawn()
                .unwrap(),
        );
        Vm {
            dir,
            uds,
            console,
            started,
            announcements: std::sync::Mutex::new(announcements),
            qemu,
            _vhost: vhost,
        }
    }

    pub fn console_text(&self) -> String {
        std::fs::read_to_string(&self.console).unwrap_or_default()
    }

    pub fn qemu_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("qemu.log")).unwrap_or_default()
    }

    /// The host client over the hybrid vsock (port 10000), waiting up to 120 s for the guest's
    /// Hello; prints how long after QEMU started it came. Panics with the console and QEMU's
    /// stderr if it never does.
    pub async fn connect(&self) -> HostClient {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        let announcements = self.announcements.lock().unwrap().take();
        let connected = match announcements {
            Some(mut a) => host::connect_announced(&self.uds, 10000, &mut a, deadline).await,
            None => host::connect(&self.uds, 10000, deadline).await,
        };
        match connected {
            Ok(c) => {
                println!(
                    "Hello {:.1} s after QEMU started",
                    self.started.elapsed().as_secs_f64()
                );
                c
            }
            Err(e) => panic!(
                "no Hello: {e}\n--- console ---\n{}\n--- qemu ---\n{}",
                self.console_text(),
                self.qemu_log()
            ),
        }
    }

    /// Wait up to 60 s for the VM to end by itself (power-off, or reboot with -no-reboot).
    pub fn wait_end(&mut self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while self.qemu.0.try_wait().unwrap().is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "VM did not end\n{}",
                self.console_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Print the console's `IMP-GUEST` stage lines.
    pub fn print_markers(&self) {
        println!("--- console (markers) ---");
        for line in self
            .console_text()
            .lines()
            .filter(|l| l.contains("IMP-GUEST"))
        {
            println!("{line}");
        }
    }
}
