//! The Firecracker simulator: Firecracker's command line and API (validated per spec.rs), a
//! serial console on stdout, and on InstanceStart imp-guest as a host process behind the
//! hybrid-vsock bridge on `uds_path`, so imp-runtime drives it exactly like a real VM.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use super::spec::{self, check_body};

const APP_NAME: &str = "Firecracker";
/// The Firecracker release the simulator (and testkit's jailer double) claims to be.
pub const VMM_VERSION: &str = "1.17.0-imp-sim";
const AGENT_PORT: u32 = 10000;

/// Behaviour knobs. Read from flags, or per VM id from the JSON file named by
/// `IMP_SIM_BEHAVIOUR` (`{"<id>": {...}, "*": {...}}`), so one runtime can host VMs that boot,
/// hang, crash and panic.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Knobs {
    /// Delay between InstanceStart and the guest agent listening.
    pub boot_delay_ms: u64,
    /// Exit with an error on stderr before creating the API socket.
    pub crash_at_start: bool,
    /// Never start the guest agent (the vsock bridge closes every connection).
    pub hang: bool,
    /// After the boot delay, write this to the serial console and exit (guest panic, reboot=k).
    pub panic_text: Option<String>,
    /// Ignore SendCtrlAltDel (a guest that does not shut down).
    pub ignore_ctrl_alt_del: bool,
    /// Delay before the API socket is bound (a slow VMM start).
    pub api_delay_ms: u64,
    /// Once booted, write this many console bytes per second until the VM stops (a guest
    /// running `yes > /dev/ttyS0`).
    pub serial_flood_bytes_per_sec: u64,
    /// While this file exists the guest agent is not started (a guest still booting): the host
    /// gets no Hello, so a chaos test holds a VM before its handoff's Sent. Test-only.
    pub hold_boot_while: Option<PathBuf>,
    /// While this file exists the guest's `started` answers are held back (a runner spawn that
    /// has not answered yet), so a chaos test holds a handoff between Sent and Started. Test-only.
    pub hold_started_while: Option<PathBuf>,
    /// How a clone's guest agent takes `Reidentify` (also `--reidentify` /
    /// `IMP_SIM_REIDENTIFY`, which override this): answer it, refuse it (the agent is started
    /// without an identity to manage), or never answer it (the frame is swallowed on its way
    /// in). Test-only.
    pub reidentify: ReidentifyKnob,
    /// A clone (a loaded snapshot) that finds no `<vsock uds>.silenced` beside its vsock socket
    /// creates it and starts no guest agent: the runtime's second restore of the VM, in the
    /// same jail, finds it and answers (a restore whose vsock device never woke up, as a QEMU
    /// clone's now and then did). Test-only.
    pub silent_first_clone: bool,
}

/// See [`Knobs::reidentify`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReidentifyKnob {
    #[default]
    Answer,
    Refuse,
    Hang,
}

impl std::str::FromStr for ReidentifyKnob {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "answer" => Ok(ReidentifyKnob::Answer),
            "refuse" => Ok(ReidentifyKnob::Refuse),
            "hang" => Ok(ReidentifyKnob::Hang),
            _ => Err(format!("{s:?}: expected answer, refuse or hang")),
        }
    }
}

impl Knobs {
    /// Knobs for VM `id` from the `IMP_SIM_BEHAVIOUR` file, if any.
    pub fn from_env(id: &str) -> Result<Option<Knobs>, String> {
        let Some(path) = std::env::var_os("IMP_SIM_BEHAVIOUR") else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("read {}: {e}", Path::new(&path).display()))?;
        let mut all: HashMap<String, Knobs> =
            serde_json::from_str(&text).map_err(|e| format!("IMP_SIM_BEHAVIOUR: {e}"))?;
        Ok(all.remove(id).or_else(|| all.remove("*")))
    }
}

/// What the simulator process should do after the API loop (the binary calls exit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Guest reset (SendCtrlAltDel or panic with reboot=k): Firecracker exits 0.
    GuestReset,
    /// A snapshot load failed after it began restoring: Firecracker answers the request, then
    /// exits with an error ("Loading snapshot failed."), the process being too dirty to reuse.
    RestoreFailed,
}

#[derive(Default)]
pub struct Options {
    pub id: String,
    pub api_sock: Option<PathBuf>,
    pub config_file: Option<PathBuf>,
    pub knobs: Knobs,
    pub guest_bin: PathBuf,
    /// `--log-path`: Firecracker's own log goes there instead of stdout (the console).
    pub log_path: Option<PathBuf>,
    /// `--level` (Error, Warning, Info, Debug, Trace, Off; case-insensitive). Default Info.
    pub log_level: Option<String>,
    /// `--show-level`: the level in every log line.
    pub show_level: bool,
    /// The simulator binary, run as the guest keeper (`--keep-guest`): the guest process then
    /// outlives this VMM when a snapshot was taken, for the VMM that loads it to adopt. None
    /// (in-process tests): the guest is this process's child and dies with it.
    pub keeper_bin: Option<PathBuf>,
}

/// Firecracker's logger levels, most severe first (`Logger.level` in the spec).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Off,
    Error,
    Warning,
    Info,
    Debug,
    Trace,
}

impl std::str::FromStr for Level {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "off" => Level::Off,
            "error" => Level::Error,
            "warning" => Level::Warning,
            "info" => Level::Info,
            "debug" => Level::Debug,
            "trace" => Level::Trace,
            _ => return Err(format!("Invalid log level: {s}")),
        })
    }
}

/// Firecracker's own (human-readable) log. Like the real binary it writes to stdout, into the
/// guest console, until `--log-path` or `PUT /logger` names a file or named pipe, which must
/// already exist: Firecracker opens it and never creates it.
struct Logger {
    id: String,
    level: Level,
    show_level: bool,
    file: Option<File>,
}

/// What marks a line as the VMM's rather than the guest's: `[<id>:<thread>` after the time.
pub const LOG_THREAD_API: &str = "fc_api";
pub const LOG_THREAD_MAIN: &str = "main";

impl Logger {
    fn configure(
        &mut self,
        path: Option<&str>,
        level: Option<&str>,
        show_level: Option<bool>,
    ) -> Result<(), String> {
        if let Some(l) = level {
            self.level = l.parse()?;
        }
        if let Some(p) = path {
            let file = std::fs::OpenOptions::new()
                .append(true)
                .open(p)
                .map_err(|e| format!("Failed to open target file: {p}: {e}"))?;
            self.file = Some(file);
        }
        if let Some(s) = show_level {
            self.show_level = s;
        }
        Ok(())
    }

    fn log(&mut self, level: Level, thread: &str, msg: &str) {
        if level > self.level || self.level == Level::Off {
            return;
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let lvl = if self.show_level {
            format!(":{}", format!("{level:?}").to_uppercase())
        } else {
            String::new()
        };
        let line = format!(
            "{}.{:09} [{}:{thread}{lvl}] {msg}\n",
            now.as_secs(),
            now.subsec_nanos(),
            self.id
        );
        match &mut self.file {
            Some(f) => {
                let _ = f.write_all(line.as_bytes());
            }
            None => {
                let mut out = std::io::stdout().lock();
                let _ = out.write_all(line.as_bytes());
                let _ = out.flush();
            }
        }
    }
}

struct Tap {
    file: File,
    mac: [u8; 6],
}

#[derive(Default)]
struct Vm {
    started: bool,
    paused: bool,
    machine: Option<Value>,
    boot_source: Option<Map<String, Value>>,
    drives: BTreeMap<String, Map<String, Value>>,
    nets: BTreeMap<String, Map<String, Value>>,
    taps: Vec<Tap>,
    vsock: Option<Map<String, Value>>,
    vsock_listener: Option<std::os::unix::net::UnixListener>,
    agent: Option<Guest>,
    /// A snapshot was taken and not resumed from: the keeper keeps the guest after this VMM.
    detached: bool,
    /// The loaded snapshot's guest memory, mapped as Firecracker maps it.
    memory: Option<GuestMemory>,
    /// A clone's identity root (`--identity-root` of its guest agent), removed with the VM.
    identity: Option<PathBuf>,
    /// This VM is a clone (a load by another VMM than the one that took the snapshot).
    clone: bool,
    /// A restore failed: the process exits once the answer is out.
    fatal: bool,
}

/// Guest memory restored from a snapshot's memory file: mapped `MAP_PRIVATE` (copy on write,
/// so the file is never written) and never read at load, as Firecracker maps it. Pages come in
/// only when touched, so a load costs the same for 64 MiB and 2 GiB, and the process's
/// resident memory (`/proc/<pid>/smaps_rollup`) counts only the pages touched. The simulated
/// guest is a host process and touches none of them.
struct GuestMemory {
    addr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is owned by this value and only unmapped on drop.
unsafe impl Send for GuestMemory {}

impl GuestMemory {
    /// Map `len` bytes of `path`. Firecracker opens the file read-only and fails when it cannot.
    fn map(path: &str, len: u64) -> std::io::Result<GuestMemory> {
        use std::os::fd::AsRawFd as _;
        let file = File::open(path)?;
        let size = file.metadata()?.len();
        if size < len {
            return Err(std::io::Error::other(format!(
                "the memory file has {size} bytes, the snapshot's memory {len}"
            )));
        }
        let len = usize::try_from(len).map_err(std::io::Error::other)?;
        // SAFETY: a fresh private mapping of a file we opened; nothing else refers to it.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(GuestMemory {
            addr,
            len: len.max(1),
        })
    }
}

impl Drop for GuestMemory {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping this value owns.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

/// The simulated guest: imp-guest as this process's child, or held by a guest keeper.
enum Guest {
    Child(Child),
    Kept {
        conn: std::os::unix::net::UnixStream,
        pid: i32,
    },
}

impl Guest {
    fn pid(&self) -> i32 {
        match self {
            Guest::Child(c) => c.id() as i32,
            Guest::Kept { pid, .. } => *pid,
        }
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: signalling the guest process we run or adopted.
        unsafe { libc::kill(self.pid(), sig) };
    }

    fn exited(&mut self) -> bool {
        match self {
            Guest::Child(c) => matches!(c.try_wait(), Ok(Some(_))),
            // SAFETY: signal 0 only checks existence.
            Guest::Kept { pid, .. } => (unsafe { libc::kill(*pid, 0) }) != 0,
        }
    }

    /// Tell the keeper something (`detach <snapshot>`, `attach`, `kill`).
    fn tell(&mut self, line: &str) -> std::io::Result<()> {
        match self {
            Guest::Child(_) => Ok(()),
            Guest::Kept { conn, .. } => conn.write_all(format!("{line}\n").as_bytes()),
        }
    }

    /// Kill the guest (and with a keeper, its whole process tree) and wait for it.
    fn kill(mut self) {
        match &mut self {
            Guest::Child(c) => {
                let _ = c.kill();
                let _ = c.wait();
            }
            Guest::Kept { conn, .. } => {
                let _ = conn.write_all(b"kill\n");
                let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
                // The keeper closes the connection once the tree is gone.
                let mut buf = [0u8; 64];
                while matches!(std::io::Read::read(conn, &mut buf), Ok(n) if n > 0) {}
            }
        }
    }
}

struct Sim {
    id: String,
    knobs: Knobs,
    guest_bin: PathBuf,
    keeper_bin: Option<PathBuf>,
    vm: Mutex<Vm>,
    logger: Mutex<Logger>,
    exit: mpsc::UnboundedSender<Exit>,
}

type Fault = (StatusCode, String);

fn fault(msg: impl Into<String>) -> Fault {
    (StatusCode::BAD_REQUEST, msg.into())
}

/// A line on the serial console (the simulator's stdout, as with Firecracker).
pub fn serial(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

const PRE_BOOT_ONLY: &str = "The requested operation is not supported after starting the microVM.";

impl Sim {
    fn put(
        &self,
        route: &str,
        param: Option<String>,
        body: Map<String, Value>,
    ) -> Result<StatusCode, Fault> {
        let mut vm = self.vm.lock().expect("vm lock");
        let pre_boot = |vm: &Vm| {
            if vm.started {
                Err(fault(PRE_BOOT_ONLY))
            } else {
                Ok(())
            }
        };
        match route {
            "/logger" => {
                pre_boot(&vm)?;
                let opt_str = |k: &str| match body.get(k) {
                    None => Ok(None),
                    Some(v) => v
                        .as_str()
                        .map(Some)
                        .ok_or_else(|| fault(format!("{k} must be a string"))),
                };
                let show = match body.get("show_level") {
                    None => None,
                    Some(v) => Some(
                        v.as_bool()
                            .ok_or_else(|| fault("show_level must be a boolean"))?,
                    ),
                };
                self.logger
                    .lock()
                    .expect("logger lock")
                    .configure(opt_str("log_path")?, opt_str("level")?, show)
                    .map_err(fault)?;
            }
            "/machine-config" => {
                pre_boot(&vm)?;
                let vcpu = body["vcpu_count"]
                    .as_u64()
                    .ok_or_else(|| fault("vcpu_count must be an integer"))?;
                if vcpu == 0 || vcpu > 32 || (vcpu > 1 && vcpu % 2 == 1) {
                    return Err(fault(format!(
                        "Invalid vCPU number {vcpu}: must be 1 or an even number up to 32"
                    )));
                }
                body["mem_size_mib"]
                    .as_u64()
                    .filter(|&m| m > 0)
                    .ok_or_else(|| fault("mem_size_mib must be a positive integer"))?;
                vm.machine = Some(Value::Object(body));
            }
            "/boot-source" => {
                pre_boot(&vm)?;
                let kernel = str_field(&body, "kernel_image_path")?;
                File::open(&kernel)
                    .map_err(|e| fault(format!("The kernel file cannot be opened: {e}")))?;
                if let Some(initrd) = body.get("initrd_path") {
                    let initrd = initrd
                        .as_str()
                        .ok_or_else(|| fault("initrd_path must be a string"))?;
                    File::open(initrd)
                        .map_err(|e| fault(format!("The initrd file cannot be opened: {e}")))?;
                }
                vm.boot_source = Some(body);
            }
            "/drives/{drive_id}" => {
                pre_boot(&vm)?;
                let id = str_field(&body, "drive_id")?;
                if Some(&id) != param.as_ref() {
                    return Err(fault(
                        "The id from the path does not match the id from the body!",
                    ));
                }
                let path = str_field(&body, "path_on_host")?;
                let ro = body
                    .get("is_read_only")
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(!ro)
                    .open(&path)
                    .map_err(|e| fault(format!("Unable to open block device {path}: {e}")))?;
                let root = body["is_root_device"]
                    .as_bool()
                    .ok_or_else(|| fault("is_root_device must be a boolean"))?;
                if root
                    && vm
                        .drives
                        .iter()
                        .any(|(k, d)| *k != id && d["is_root_device"] == json!(true))
                {
                    return Err(fault("A root block device already exists!"));
                }
                vm.drives.insert(id, body);
            }
            "/network-interfaces/{iface_id}" => {
                pre_boot(&vm)?;
                let id = str_field(&body, "iface_id")?;
                if Some(&id) != param.as_ref() {
                    return Err(fault(
                        "The id from the path does not match the id from the body!",
                    ));
                }
                let dev = str_field(&body, "host_dev_name")?;
                let mac = match body.get("guest_mac") {
                    Some(m) => parse_mac(m.as_str().unwrap_or(""))
                        .ok_or_else(|| fault(format!("Invalid MAC address {m}")))?,
                    None => [0x06, 0, 0, 0, 0, 1],
                };
                let file = open_tap(&dev)
                    .map_err(|e| fault(format!("Open tap device failed: {dev}: {e}")))?;
                vm.taps.push(Tap { file, mac });
                vm.nets.insert(id, body);
            }
            "/vsock" => {
                pre_boot(&vm)?;
                let cid = body["guest_cid"]
                    .as_u64()
                    .ok_or_else(|| fault("guest_cid must be an integer"))?;
                if cid < 3 {
                    return Err(fault(format!(
                        "Invalid guest CID {cid}: must be at least 3"
                    )));
                }
                let uds = str_field(&body, "uds_path")?;
                // Firecracker binds uds_path when the device is configured.
                let listener = std::os::unix::net::UnixListener::bind(&uds).map_err(|e| {
                    fault(format!(
                        "Cannot create backend for vsock device: {uds}: {e}"
                    ))
                })?;
                vm.vsock_listener = Some(listener);
                vm.vsock = Some(body);
            }
            "/actions" => {
                let action = str_field(&body, "action_type")?;
                match action.as_str() {
                    "InstanceStart" => {
                        pre_boot(&vm)?;
                        self.start(&mut vm)?;
                    }
                    "SendCtrlAltDel" => {
                        if !vm.started {
                            return Err(fault(
                                "The requested operation is not supported before starting the microVM.",
                            ));
                        }
                        if !self.knobs.ignore_ctrl_alt_del {
                            serial("reboot: Restarting system");
                            let _ = self.exit.send(Exit::GuestReset);
                        }
                    }
                    "FlushMetrics" => return Err(fault("The metrics system is not initialized.")),
                    other => return Err(fault(format!("unknown variant `{other}`"))),
                }
            }
            "/vm" => {
                if !vm.started {
                    return Err(fault(
                        "The requested operation is not supported before starting the microVM.",
                    ));
                }
                let state = str_field(&body, "state")?;
                let signal = match state.as_str() {
                    "Paused" => libc::SIGSTOP,
                    "Resumed" => libc::SIGCONT,
                    other => {
                        return Err(fault(format!(
                            "unknown variant `{other}`, expected `Paused` or `Resumed`"
                        )));
                    }
                };
                // A paused VM runs no guest code: stop the agent process.
                if let Some(agent) = &vm.agent {
                    agent.signal(signal);
                }
                vm.paused = state == "Paused";
                // Resumed after a snapshot: this VMM runs the guest on, its keeper must no
                // longer keep it past this process.
                if !vm.paused && vm.detached {
                    vm.detached = false;
                    if let Some(agent) = &mut vm.agent {
                        let _ = agent.tell("attach");
                    }
                }
            }
            "/snapshot/create" => {
                if !vm.paused {
                    return Err(fault("Cannot create snapshot: the microVM is not paused."));
                }
                let snap = str_field(&body, "snapshot_path")?;
                let mem = str_field(&body, "mem_file_path")?;
                let state = json!({
                    "machine-config": vm.machine, "boot-source": vm.boot_source,
                    "drives": vm.drives, "network-interfaces": vm.nets, "vsock": vm.vsock,
                    // Which VMM took it: a load by another one starts a clone.
                    "imp-sim": {"vmm_id": self.id},
                });
                std::fs::write(&snap, serde_json::to_vec(&state).expect("json"))
                    .map_err(|e| fault(format!("Cannot write snapshot {snap}: {e}")))?;
                let mib = vm
                    .machine
                    .as_ref()
                    .and_then(|m| m["mem_size_mib"].as_u64())
                    .unwrap_or(128);
                File::create(&mem)
                    .and_then(|f| f.set_len(mib << 20))
                    .map_err(|e| fault(format!("Cannot write memory file {mem}: {e}")))?;
                // The guest's "memory" is its process: the keeper holds it past this VMM
                // until the snapshot file goes (the VM was deleted) or a VMM loads it.
                if let Some(agent) = &mut vm.agent {
                    agent
                        .tell(&format!("detach {snap}"))
                        .map_err(|e| fault(format!("Cannot hand the guest to its keeper: {e}")))?;
                    vm.detached = true;
                }
            }
            "/snapshot/load" => {
                // Any pre-boot resource but the logger makes this the boot path.
                if vm.started
                    || vm.boot_source.is_some()
                    || vm.machine.is_some()
                    || !vm.drives.is_empty()
                    || !vm.nets.is_empty()
                    || vm.vsock.is_some()
                {
                    return Err(fault(
                        "Load snapshot error: Loading a microVM snapshot not allowed after configuring boot-specific resources.",
                    ));
                }
                let params = LoadParams::parse(body).map_err(fault)?;
                // From here on a failure leaves the process unusable, as Firecracker's does.
                if let Err(e) = self.restore(&mut vm, &params) {
                    vm.fatal = true;
                    return Err(fault(format!(
                        "Load snapshot error: Failed to restore from snapshot: {e}"
                    )));
                }
            }
            _ => unreachable!("route table and dispatcher agree"),
        }
        Ok(StatusCode::NO_CONTENT)
    }

    /// `PUT /snapshot/load` past its checks, in Firecracker's order (`restore_from_snapshot`):
    /// the state file, the overrides, the guest memory, the devices (drives, TAPs, then the
    /// vsock socket), then the guest. The error is the text Firecracker nests under "Failed to restore
    /// from snapshot: ".
    ///
    /// The guest: a load by the VMM that took the snapshot (same `--id`) at the snapshot's own
    /// vsock path adopts the snapshot's guest from its keeper (a resume). Any other load is a
    /// *clone*: a fresh guest agent process on the loaded VM's vsock path, with an identity root
    /// of its own (`<uds_path>.identity/`) so it takes `Reidentify`. A host-process clone
    /// starts from the agent's start, not from the snapshot's memory: nothing a guest held in
    /// memory (its identity generation, processes, files in its root) carries over; what the
    /// simulator does keep is the API behaviour, the files and the timing shape of a load.
    fn restore(&self, vm: &mut Vm, p: &LoadParams) -> Result<(), String> {
        let from_file = "Failed to get snapshot state from file";
        let bytes = std::fs::read(&p.snapshot_path)
            .map_err(|e| format!("{from_file}: Failed to open snapshot file: {e}"))?;
        let state: Value = serde_json::from_slice(&bytes)
            .map_err(|e| format!("{from_file}: Failed to load snapshot state from file: {e}"))?;
        let mut nets = objects(&state["network-interfaces"]);
        for (iface, dev) in &p.network_overrides {
            nets.get_mut(iface)
                .ok_or_else(|| format!("{from_file}: Unknown Network Device."))?
                .insert("host_dev_name".into(), json!(dev));
        }
        let mut vsock = state["vsock"].as_object().cloned();
        if let Some(uds) = &p.vsock_override {
            vsock
                .as_mut()
                .ok_or_else(|| format!("{from_file}: Unknown Vsock Device."))?
                .insert("uds_path".into(), json!(uds));
        }
        let mib = state["machine-config"]["mem_size_mib"]
            .as_u64()
            .unwrap_or(128);
        let memory = GuestMemory::map(&p.mem_path, mib << 20).map_err(|e| {
            format!(
                "Failed to load guest memory: Error creating guest memory from file: Failed to load guest memory: {e}"
            )
        })?;
        let devices = "Failed to build microVM from snapshot: Failed to restore devices: Error restoring MMIO devices";
        // Drives: at the paths they had (a load has no override for them).
        let drives = objects(&state["drives"]);
        for d in drives.values() {
            let path = d
                .get("path_on_host")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let ro = d.get("is_read_only").and_then(Value::as_bool) == Some(true);
            std::fs::OpenOptions::new()
                .read(true)
                .write(!ro)
                .open(path)
                .map_err(|e| {
                    format!(
                        "{devices}: Block: Virtio backend error: Error manipulating the backing file: {e} {path}"
                    )
                })?;
        }
        // A jailed Firecracker has no CAP_NET_ADMIN: TUNSETIFF attaches to an existing TAP
        // and cannot create one (EPERM).
        let mut taps = Vec::new();
        for n in nets.values() {
            let dev = n
                .get("host_dev_name")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let opened = if tap_exists(dev) {
                open_tap(dev)
            } else {
                Err(std::io::Error::from_raw_os_error(libc::EPERM))
            };
            let file = opened.map_err(|e| {
                format!(
                    "{devices}: Net: Failed to create a network device: Open tap device failed: Error while creating ifreq structure: {e}. Invalid TUN/TAP Backend provided by {dev}. Check our documentation on setting up the network devices."
                )
            })?;
            let mac = n
                .get("guest_mac")
                .and_then(Value::as_str)
                .and_then(parse_mac)
                .unwrap_or([0x06, 0, 0, 0, 0, 1]);
            taps.push(Tap { file, mac });
        }
        let vsock = vsock.ok_or("The simulator needs a vsock device to reach the guest agent.")?;
        let uds = vsock
            .get("uds_path")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        // The muxer binds the path: a file left there fails the load.
        let listener = std::os::unix::net::UnixListener::bind(&uds).map_err(|e| {
            format!("{devices}: VsockUnixBackend: Error binding to the host-side Unix socket: {e}")
        })?;
        let own = state["imp-sim"]["vmm_id"].as_str() == Some(self.id.as_str())
            && state["vsock"]["uds_path"].as_str() == Some(uds.as_str());
        vm.machine = state.get("machine-config").cloned();
        vm.boot_source = state["boot-source"].as_object().cloned();
        vm.drives = drives;
        vm.nets = nets;
        vm.taps = taps;
        vm.vsock = Some(vsock);
        vm.vsock_listener = Some(listener);
        vm.memory = Some(memory);
        let adopted = if own {
            self.adopt(&uds, &p.snapshot_path)?
        } else {
            vm.clone = true;
            vm.identity = self.clone_identity(&uds);
            serial(&format!(
                "imp-firecracker-sim: clone of snapshot {}: a fresh guest agent (a host-process clone starts from the agent's start, not from the snapshot's memory)",
                p.snapshot_path
            ));
            None
        };
        self.start_with(vm, adopted).map_err(|(_, m)| m)?;
        // A paused VM runs no guest code: an adopted guest is still stopped from the pause
        // before its snapshot, a clone's fresh one is stopped here.
        let signal = if p.resume_vm {
            libc::SIGCONT
        } else {
            vm.paused = true;
            libc::SIGSTOP
        };
        if let Some(agent) = &vm.agent {
            agent.signal(signal);
        }
        Ok(())
    }

    /// The snapshot's guest, held by its keeper since the snapshot was taken. A real snapshot
    /// holds the guest's memory, so it restores even after the VMM that took it stopped; the
    /// simulator's guest is a process, so when its keeper is gone (the VM was stopped) a fresh
    /// guest agent starts instead, and the serial log says so. Process continuity across a
    /// suspend is what the runtime's tests check: they fail on this fallback.
    fn adopt(&self, uds: &str, snap: &str) -> Result<Option<Guest>, String> {
        if self.keeper_bin.is_none() {
            return Ok(None);
        }
        let agent_sock = PathBuf::from(format!("{uds}.agent"));
        match connect_keeper(&agent_sock) {
            Ok(mut g) => {
                g.tell("attach")
                    .map_err(|e| format!("Cannot adopt the guest: {e}"))?;
                Ok(Some(g))
            }
            Err(e) => {
                serial(&format!(
                    "imp-firecracker-sim: the guest of snapshot {snap} is gone (keeper {}: {e}); starting a fresh guest agent",
                    keeper_socket(&agent_sock).display()
                ));
                Ok(None)
            }
        }
    }

    /// A clone guest's identity root, `<uds>.identity/` (its `etc/machine-id` and
    /// `etc/resolv.conf`); `None` when its agent is to refuse `Reidentify`: the knob says so, or
    /// this process cannot give it a hostname and entropy of its own (the agent runs in a UTS
    /// namespace of its own and seeds the kernel's pool: both need CAP_SYS_ADMIN, which a
    /// jailed simulator does not have).
    fn clone_identity(&self, uds: &str) -> Option<PathBuf> {
        if self.knobs.reidentify == ReidentifyKnob::Refuse {
            serial(
                "imp-firecracker-sim: knob reidentify=refuse: this clone's agent manages no identity",
            );
            return None;
        }
        if !has_cap_sys_admin() {
            serial("imp-firecracker-sim: no CAP_SYS_ADMIN: this clone's agent manages no identity");
            return None;
        }
        let root = PathBuf::from(format!("{uds}.identity"));
        let _ = std::fs::remove_dir_all(&root);
        match std::fs::create_dir_all(root.join("etc")) {
            Ok(()) => Some(root),
            Err(e) => {
                serial(&format!(
                    "imp-firecracker-sim: cannot make the clone's identity root {}: {e}",
                    root.display()
                ));
                None
            }
        }
    }

    /// InstanceStart: serial boot banner, a gratuitous ARP out of every TAP, the vsock bridge,
    /// and (after the boot delay) the guest agent, unless a knob says hang or panic.
    fn start(&self, vm: &mut Vm) -> Result<(), Fault> {
        self.start_with(vm, None)
    }

    /// `start`, with the guest of a loaded snapshot (adopted from its keeper) if any.
    fn start_with(&self, vm: &mut Vm, adopted: Option<Guest>) -> Result<(), Fault> {
        let boot = vm
            .boot_source
            .clone()
            .ok_or_else(|| fault("Cannot start microvm without kernel configuration."))?;
        let Some(listener) = vm.vsock_listener.take() else {
            return Err(fault(
                "The simulator needs a vsock device to reach the guest agent.",
            ));
        };
        let uds = str_field(
            vm.vsock.as_ref().expect("listener implies config"),
            "uds_path",
        )?;
        vm.started = true;
        serial(&format!(
            "[    0.000000] Linux version 6.1.0-imp-sim ({APP_NAME} simulator, id {})",
            self.id
        ));
        serial(&format!(
            "[    0.000000] Command line: {}",
            boot.get("boot_args").and_then(Value::as_str).unwrap_or("")
        ));
        for tap in &mut vm.taps {
            let _ = tap.file.write_all(&gratuitous_arp(tap.mac));
        }
        let agent_sock = PathBuf::from(format!("{uds}.agent"));
        listener
            .set_nonblocking(true)
            .map_err(|e| fault(e.to_string()))?;
        let listener =
            tokio::net::UnixListener::from_std(listener).map_err(|e| fault(e.to_string()))?;
        // With hold_started_while, or a clone whose Reidentify is to hang, the bridge reaches
        // the agent through a frame-aware relay.
        let swallow_reidentify = vm.clone && self.knobs.reidentify == ReidentifyKnob::Hang;
        let route = if self.knobs.hold_started_while.is_some() || swallow_reidentify {
            let relay = PathBuf::from(format!("{uds}.hold"));
            let _ = std::fs::remove_file(&relay);
            let relay_listener = tokio::net::UnixListener::bind(&relay)
                .map_err(|e| fault(format!("bind {}: {e}", relay.display())))?;
            tokio::spawn(hold_relay(
                relay_listener,
                agent_sock.clone(),
                self.knobs.hold_started_while.clone(),
                swallow_reidentify,
            ));
            relay
        } else {
            agent_sock.clone()
        };
        tokio::spawn(imp_guest::hybrid::serve_bridge(
            listener,
            HashMap::from([(AGENT_PORT, route)]),
        ));
        if let Some(g) = adopted {
            serial("[    0.000000] imp-sim: snapshot loaded, guest adopted from its keeper");
            vm.agent = Some(g);
            return Ok(());
        }
        let knobs = self.knobs.clone();
        if vm.clone
            && knobs.silent_first_clone
            && std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(format!("{uds}.silenced"))
                .is_ok()
        {
            serial("[    0.100000] imp-sim: silent_first_clone: no guest agent this time");
            return Ok(());
        }
        if knobs.hang {
            serial("[    0.100000] imp-sim: hanging (no guest agent)");
            return Ok(());
        }
        if knobs.boot_delay_ms > 0 || knobs.panic_text.is_some() || knobs.hold_boot_while.is_some()
        {
            // The agent is spawned later by the boot task.
            return Ok(());
        }
        vm.agent = Some(
            self.spawn_guest(&agent_sock, vm.identity.as_deref())
                .map_err(|e| fault(format!("start imp-guest: {e}")))?,
        );
        Ok(())
    }

    fn spawn_guest(&self, agent_sock: &Path, identity: Option<&Path>) -> std::io::Result<Guest> {
        match &self.keeper_bin {
            Some(bin) => spawn_keeper(bin, &self.guest_bin, agent_sock, identity),
            None => spawn_agent(&self.guest_bin, agent_sock, identity).map(Guest::Child),
        }
    }
}

/// `SnapshotLoadParams` as Firecracker deserialises it (`LoadSnapshotConfig`,
/// src/vmm/src/vmm_config/snapshot.rs, and `parse_put_snapshot_load`): unknown fields are refused
/// at the top and in `mem_backend` (`deny_unknown_fields`), not inside the overrides (their
/// structs do not deny them); exactly one of `mem_backend` and the deprecated `mem_file_path`.
#[derive(Debug, Clone, PartialEq)]
struct LoadParams {
    snapshot_path: String,
    mem_path: String,
    resume_vm: bool,
    network_overrides: Vec<(String, String)>,
    vsock_override: Option<String>,
}

/// Firecracker's texts for the two `mem_*` fields (api_server/request/snapshot.rs).
const MISSING_MEM: &str = "missing field: either `mem_backend` or `mem_file_path` is required";
const TOO_MANY_MEM: &str =
    "too many fields: either `mem_backend` or `mem_file_path` exclusively is required";

impl LoadParams {
    fn parse(body: Map<String, Value>) -> Result<LoadParams, String> {
        let bad = |m: String| {
            format!("An error occurred when deserializing the json body of a request: {m}")
        };
        let string = |v: &Value, what: &str| {
            v.as_str()
                .map(String::from)
                .ok_or_else(|| bad(format!("invalid type: {v}, expected a string ({what})")))
        };
        for flag in [
            "enable_diff_snapshots",
            "track_dirty_pages",
            "resume_vm",
            "clock_realtime",
        ] {
            if let Some(v) = body.get(flag)
                && !v.is_boolean()
            {
                return Err(bad(format!(
                    "invalid type: {v}, expected a boolean ({flag})"
                )));
            }
        }
        if let Some(v) = body.get("huge_pages")
            && !matches!(v.as_str(), Some("Snapshot" | "None" | "Transparent" | "2M"))
        {
            return Err(bad(format!(
                "unknown variant {v}, expected one of `Snapshot`, `None`, `Transparent`, `2M` (huge_pages)"
            )));
        }
        let mem_path = match (body.get("mem_backend"), body.get("mem_file_path")) {
            (Some(_), Some(_)) => return Err(bad(TOO_MANY_MEM.into())),
            (None, None) => return Err(bad(MISSING_MEM.into())),
            (None, Some(path)) => string(path, "mem_file_path")?,
            (Some(backend), None) => {
                let b =
                    spec::check_object(spec::definition("MemoryBackend"), backend.clone(), true)
                        .map_err(|e| bad(format!("mem_backend: {e}")))?;
                match b["backend_type"].as_str() {
                    Some("File") => {}
                    Some("Uffd") => {
                        return Err(bad(
                            "backend_type Uffd: the simulator serves guest memory from a file only"
                                .into(),
                        ));
                    }
                    _ => {
                        return Err(bad(format!(
                            "unknown variant {}, expected `File` or `Uffd` (backend_type)",
                            b["backend_type"]
                        )));
                    }
                }
                string(&b["backend_path"], "backend_path")?
            }
        };
        let mut network_overrides = Vec::new();
        if let Some(list) = body.get("network_overrides") {
            let list = list.as_array().ok_or_else(|| {
                bad(format!(
                    "invalid type: {list}, expected a sequence (network_overrides)"
                ))
            })?;
            for o in list {
                let o = spec::check_object(spec::definition("NetworkOverride"), o.clone(), false)
                    .map_err(|e| bad(format!("network_overrides: {e}")))?;
                network_overrides.push((
                    string(&o["iface_id"], "iface_id")?,
                    string(&o["host_dev_name"], "host_dev_name")?,
                ));
            }
        }
        let vsock_override = match body.get("vsock_override") {
            None => None,
            Some(o) => {
                let o = spec::check_object(spec::definition("VsockOverride"), o.clone(), false)
                    .map_err(|e| bad(format!("vsock_override: {e}")))?;
                Some(string(&o["uds_path"], "uds_path")?)
            }
        };
        Ok(LoadParams {
            snapshot_path: string(&body["snapshot_path"], "snapshot_path")?,
            mem_path,
            resume_vm: body.get("resume_vm").and_then(Value::as_bool) == Some(true),
            network_overrides,
            vsock_override,
        })
    }
}

/// The objects of a JSON object by key (the drives and interfaces of a snapshot's state).
fn objects(v: &Value) -> BTreeMap<String, Map<String, Value>> {
    v.as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_object()?.clone())))
                .collect()
        })
        .unwrap_or_default()
}

/// A network interface of that name exists in this thread's network namespace.
fn tap_exists(name: &str) -> bool {
    let Ok(c) = std::ffi::CString::new(name) else {
        return false;
    };
    // SAFETY: if_nametoindex reads the NUL-terminated name we own.
    unsafe { libc::if_nametoindex(c.as_ptr()) != 0 }
}

/// This process holds CAP_SYS_ADMIN in its effective set (capget(2): a jail has no /proc).
fn has_cap_sys_admin() -> bool {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    const CAP_SYS_ADMIN: u32 = 21;
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget writes two Data structs (version 3) into the array we own.
    let r = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    r == 0 && data[0].effective & (1 << CAP_SYS_ADMIN) != 0
}

fn str_field(body: &Map<String, Value>, key: &str) -> Result<String, Fault> {
    body.get(key)
        .and_then(Value::as_str)
        .map(String::from)
        .ok_or_else(|| fault(format!("{key} must be a string")))
}

fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let parts: Vec<u8> = s
        .split(':')
        .map(|p| u8::from_str_radix(p, 16).ok())
        .collect::<Option<_>>()?;
    parts.try_into().ok()
}

/// An Ethernet frame with an ARP announcement from the guest: 42 bytes on the host's rx counter.
fn gratuitous_arp(mac: [u8; 6]) -> Vec<u8> {
    let mut f = Vec::with_capacity(42);
    f.extend_from_slice(&[0xff; 6]);
    f.extend_from_slice(&mac);
    f.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    f.extend_from_slice(&mac);
    f.extend_from_slice(&[10, 0, 0, 2]);
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&[10, 0, 0, 2]);
    f
}

/// Attach to TAP `name` as Firecracker does (TUNSETIFF, IFF_TAP | IFF_NO_PI), in the calling
/// thread's network namespace; TUNSETIFF creates the TAP when it does not exist.
pub fn open_tap(name: &str) -> std::io::Result<File> {
    const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "bad interface name",
        ));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")?;
    #[repr(C)]
    struct IfReq {
        name: [u8; libc::IFNAMSIZ],
        flags: libc::c_short,
        _pad: [u8; 22],
    }
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short,
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads an ifreq we own for the duration of the call.
    let r = unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&file), TUNSETIFF, &mut req) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

/// Run imp-guest in host-process mode, its output on the serial console, and killed with the
/// simulator (a guest never outlives its VMM). Must be called from the main thread (the
/// parent-death signal follows the spawning thread). With `identity` (a clone's identity root)
/// the agent takes `Reidentify`, in a UTS namespace of its own (its hostname is not the host's).
fn spawn_agent(guest_bin: &Path, sock: &Path, identity: Option<&Path>) -> std::io::Result<Child> {
    let mut cmd = Command::new(guest_bin);
    cmd.arg("agent")
        .arg("--listen-unix")
        .arg(sock)
        // The guest's connection to the host's READY port, as the hybrid vsock delivers it:
        // to `<uds_path>_<port>` (the agent's socket is `<uds_path>.agent`).
        .arg("--announce-unix")
        .arg(imp_guest::host::announce_path(&sock.with_extension("")))
        .stdin(Stdio::null());
    if let Some(root) = identity {
        cmd.arg("--identity-root").arg(root);
    }
    let own_uts = identity.is_some();
    // SAFETY: prctl and unshare are async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if own_uts && libc::unshare(libc::CLONE_NEWUTS) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    serial("[    0.200000] imp-guest: agent started");
    Ok(child)
}

/// The keeper's control socket, beside the guest agent's.
pub fn keeper_socket(agent_sock: &Path) -> PathBuf {
    PathBuf::from(format!("{}.keeper", agent_sock.display()))
}

/// Start a guest keeper (`<sim> --keep-guest <agent_sock>`) in a session of its own and
/// connect to it.
fn spawn_keeper(
    bin: &Path,
    guest_bin: &Path,
    agent_sock: &Path,
    identity: Option<&Path>,
) -> std::io::Result<Guest> {
    let ctl = keeper_socket(agent_sock);
    let _ = std::fs::remove_file(&ctl);
    let mut cmd = Command::new(bin);
    cmd.arg("--keep-guest")
        .arg(agent_sock)
        .arg("--guest-bin")
        .arg(guest_bin)
        .stdin(Stdio::null());
    if let Some(root) = identity {
        cmd.arg("--identity-root").arg(root);
    }
    // SAFETY: setsid is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    // Reaped here while this VMM lives; after that, by whoever inherits it.
    std::thread::spawn(move || {
        let _ = child.wait();
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match connect_keeper(agent_sock) {
            Ok(g) => return Ok(g),
            Err(e) if std::time::Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// Connect to the keeper of `agent_sock`'s guest; it answers `pid <guest pid>`.
fn connect_keeper(agent_sock: &Path) -> std::io::Result<Guest> {
    use std::io::BufRead as _;
    let conn = std::os::unix::net::UnixStream::connect(keeper_socket(agent_sock))?;
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut line = String::new();
    std::io::BufReader::new(conn.try_clone()?).read_line(&mut line)?;
    conn.set_read_timeout(None)?;
    let pid = line
        .trim()
        .strip_prefix("pid ")
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("keeper said {line:?}")))?;
    Ok(Guest::Kept { conn, pid })
}

/// The guest keeper: runs imp-guest (the simulated guest, and everything it starts) so that
/// it can outlive the VMM that snapshotted it, the way a real guest's memory outlives its
/// Firecracker in the snapshot file. One VMM at a time is connected on the control socket:
/// - the connection closes without a snapshot (the VMM stopped or died): the guest tree is
///   killed, the keeper exits;
/// - `detach <snapshot>` (snapshot taken): a closed connection keeps the guest, for the next
///   VMM to adopt (`attach`), until the snapshot file disappears (the VM was deleted): then
///   the tree is killed and the keeper exits;
/// - `kill`: the tree is killed, the connection closed, the keeper exits;
/// - the guest exits by itself: the keeper kills what is left and exits.
///
/// The keeper is a child subreaper, so every process the guest starts stays its descendant.
/// A clone's guest (`identity`: its identity root) has that directory removed with it.
pub fn keep_guest(
    guest_bin: &Path,
    agent_sock: &Path,
    identity: Option<&Path>,
) -> Result<(), String> {
    use std::io::BufRead as _;
    // SAFETY: prctl on this process.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) };
    let ctl = keeper_socket(agent_sock);
    let _ = std::fs::remove_file(&ctl);
    let listener = std::os::unix::net::UnixListener::bind(&ctl)
        .map_err(|e| format!("bind {}: {e}", ctl.display()))?;
    let guest = spawn_agent(guest_bin, agent_sock, identity)
        .map_err(|e| format!("start imp-guest: {e}"))?;
    let guest_pid = guest.id() as i32;
    let detached: Arc<Mutex<Option<PathBuf>>> = Arc::default();
    let connected = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let finish = {
        let ctl = ctl.clone();
        let identity = identity.map(Path::to_path_buf);
        move || -> ! {
            kill_descendants();
            let _ = std::fs::remove_file(&ctl);
            if let Some(root) = &identity {
                let _ = std::fs::remove_dir_all(root);
            }
            std::process::exit(0)
        }
    };
    // Reap everything; the guest's own exit ends the keeper.
    {
        let finish = finish.clone();
        std::thread::spawn(move || {
            loop {
                let mut status = 0;
                // SAFETY: waitpid on our children.
                let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
                if pid == guest_pid {
                    finish();
                }
                if pid < 0 {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        });
    }
    // A deleted VM: its snapshot is gone and no VMM holds the guest.
    {
        let (finish, detached, connected) = (finish.clone(), detached.clone(), connected.clone());
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(Duration::from_millis(100));
                let gone = detached
                    .lock()
                    .expect("keeper state")
                    .as_ref()
                    .is_some_and(|p| !p.exists());
                if gone && !connected.load(std::sync::atomic::Ordering::SeqCst) {
                    finish();
                }
            }
        });
    }
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        connected.store(true, std::sync::atomic::Ordering::SeqCst);
        if conn
            .write_all(format!("pid {guest_pid}\n").as_bytes())
            .is_err()
        {
            connected.store(false, std::sync::atomic::Ordering::SeqCst);
            continue;
        }
        let reader = std::io::BufReader::new(match conn.try_clone() {
            Ok(c) => c,
            Err(_) => continue,
        });
        for line in reader.lines() {
            let Ok(line) = line else { break };
            let line = line.trim();
            if let Some(path) = line.strip_prefix("detach ") {
                *detached.lock().expect("keeper state") = Some(PathBuf::from(path));
            } else if line == "attach" {
                *detached.lock().expect("keeper state") = None;
            } else if line == "kill" {
                finish();
            }
        }
        connected.store(false, std::sync::atomic::Ordering::SeqCst);
        if detached.lock().expect("keeper state").is_none() {
            finish();
        }
    }
    Ok(())
}

/// SIGKILL every descendant of this process (repeatedly: a dying parent's children are
/// reparented to us, the subreaper), then reap them.
fn kill_descendants() {
    let me = std::process::id() as i32;
    for _ in 0..50 {
        let kids = descendants(me);
        if kids.is_empty() {
            return;
        }
        for pid in kids {
            // SAFETY: SIGKILL to our own descendants.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        loop {
            let mut status = 0;
            // SAFETY: non-blocking reap of our children.
            if unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) } <= 0 {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Live (non-zombie) descendants of `root`, from /proc.
fn descendants(root: i32) -> Vec<i32> {
    let mut parent: Vec<(i32, i32)> = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // After the command's closing parenthesis: state, ppid.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let mut f = rest.split_whitespace();
        let state = f.next().unwrap_or("");
        let Some(ppid) = f.next().and_then(|p| p.parse().ok()) else {
            continue;
        };
        if state != "Z" {
            parent.push((pid, ppid));
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for &(c, pp) in &parent {
            if pp == p && !out.contains(&c) {
                out.push(c);
                frontier.push(c);
            }
        }
    }
    out
}

async fn handle(State(sim): State<Arc<Sim>>, req: Request) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let Some((route, param)) = spec::match_route(method.as_str(), &path) else {
        return err_response(fault(format!(
            "Invalid request method and/or path: {method} {path}"
        )));
    };
    let body: Bytes = match axum::body::to_bytes(req.into_body(), 1 << 20).await {
        Ok(b) => b,
        Err(e) => return err_response(fault(format!("Invalid request body: {e}"))),
    };
    sim.log(
        Level::Info,
        LOG_THREAD_API,
        &format!(
            "The API server received a {} request on {path:?} with body {:?}.",
            titlecase(method.as_str()),
            String::from_utf8_lossy(&body)
        ),
    );
    if method == Method::GET {
        let vm = sim.vm.lock().expect("vm lock");
        return match route.path {
            "/" => {
                let state = match (vm.started, vm.paused) {
                    (false, _) => "Not started",
                    (true, false) => "Running",
                    (true, true) => "Paused",
                };
                axum::Json(json!({"app_name": APP_NAME, "id": sim.id, "state": state, "vmm_version": VMM_VERSION})).into_response()
            }
            _ => axum::Json(
                vm.machine
                    .clone()
                    .unwrap_or_else(|| json!({"vcpu_count": 1, "mem_size_mib": 128, "smt": false})),
            )
            .into_response(),
        };
    }
    let def = spec::definition(route.body.expect("non-GET routes take a body"));
    let map = match check_body(def, &body) {
        Ok(m) => m,
        Err(e) => return err_response(fault(e)),
    };
    let was_started = sim.vm.lock().expect("vm lock").started;
    match sim.put(route.path, param, map) {
        Ok(code) => {
            let now_started = sim.vm.lock().expect("vm lock").started;
            if !was_started && now_started {
                boot_task(sim.clone());
            }
            sim.log(
                Level::Debug,
                LOG_THREAD_API,
                &format!("The request was executed successfully. Status code: {code}."),
            );
            code.into_response()
        }
        Err(f) => {
            sim.log(
                Level::Error,
                LOG_THREAD_API,
                &format!("Received Error. Status code: {}. Message: {}", f.0, f.1),
            );
            // A failed restore: Firecracker answers, then its pre-boot loop ends and it exits.
            if sim.vm.lock().expect("vm lock").fatal {
                let exit = sim.exit.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let _ = exit.send(Exit::RestoreFailed);
                });
            }
            err_response(f)
        }
    }
}

fn titlecase(method: &str) -> String {
    let lower = method.to_ascii_lowercase();
    let mut c = lower.chars();
    c.next()
        .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
        .unwrap_or_default()
}

impl Sim {
    fn log(&self, level: Level, thread: &str, msg: &str) {
        self.logger
            .lock()
            .expect("logger lock")
            .log(level, thread, msg);
    }
}

/// Delayed boot: after the boot delay, either panic (serial text, then exit like reboot=k) or
/// start the agent. The agent is spawned from the main thread (the exit channel's consumer).
fn boot_task(sim: Arc<Sim>) {
    if sim.knobs.serial_flood_bytes_per_sec > 0 {
        tokio::spawn(flood(sim.knobs.serial_flood_bytes_per_sec));
    }
    if sim.knobs.hang
        || (sim.knobs.boot_delay_ms == 0
            && sim.knobs.panic_text.is_none()
            && sim.knobs.hold_boot_while.is_none())
    {
        return;
    }
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(sim.knobs.boot_delay_ms)).await;
        if let Some(hold) = &sim.knobs.hold_boot_while {
            while hold.exists() {
                tokio::time::sleep(HOLD_POLL).await;
            }
        }
        if let Some(text) = &sim.knobs.panic_text {
            for line in text.lines() {
                serial(line);
            }
            let _ = sim.exit.send(Exit::GuestReset);
            return;
        }
        let uds = sim
            .vm
            .lock()
            .expect("vm lock")
            .vsock
            .as_ref()
            .and_then(|v| v["uds_path"].as_str().map(String::from));
        if let Some(uds) = uds {
            let identity = {
                let vm = sim.vm.lock().expect("vm lock");
                if vm.agent.is_some() {
                    return;
                }
                vm.identity.clone()
            };
            match sim.spawn_guest(Path::new(&format!("{uds}.agent")), identity.as_deref()) {
                Ok(child) => sim.vm.lock().expect("vm lock").agent = Some(child),
                Err(e) => serial(&format!("imp-sim: cannot start imp-guest: {e}")),
            }
        }
    });
}

/// How often a held boot or answer looks whether its hold file is gone.
const HOLD_POLL: Duration = Duration::from_millis(100);

/// The relay of `hold_started_while` and `reidentify: hang`: frames (u32 big-endian length +
/// JSON) pass one by one; a guest's `started` answer waits while `hold` exists; with
/// `swallow_reidentify` a host's `reidentify` request is dropped (the guest never sees it, the
/// host never gets an answer).
async fn hold_relay(
    listener: tokio::net::UnixListener,
    agent: PathBuf,
    hold: Option<PathBuf>,
    swallow_reidentify: bool,
) {
    while let Ok((host, _)) = listener.accept().await {
        let (agent, hold) = (agent.clone(), hold.clone());
        tokio::spawn(async move {
            let Ok(guest) = tokio::net::UnixStream::connect(&agent).await else {
                return;
            };
            let (mut host_rd, mut host_wr) = host.into_split();
            let (mut guest_rd, mut guest_wr) = guest.into_split();
            let up = async {
                if swallow_reidentify {
                    drop_frames(&mut host_rd, &mut guest_wr, "reidentify").await
                } else {
                    tokio::io::copy(&mut host_rd, &mut guest_wr)
                        .await
                        .map(|_| ())
                }
            };
            let down = async {
                match &hold {
                    Some(hold) => relay_frames(&mut guest_rd, &mut host_wr, hold).await,
                    None => tokio::io::copy(&mut guest_rd, &mut host_wr)
                        .await
                        .map(|_| ()),
                }
            };
            tokio::select! {
                _ = up => {}
                _ = down => {}
            }
        });
    }
}

/// One frame from `from`: its length prefix as read, and its payload.
async fn read_frame<R>(from: &mut R) -> std::io::Result<([u8; 4], Vec<u8>)>
where
    R: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt as _;
    let mut len = [0u8; 4];
    from.read_exact(&mut len).await?;
    let n = u32::from_be_bytes(len) as usize;
    if n > imp_guest::frame::MAX_FRAME_BYTES {
        return Err(std::io::Error::other("frame too large"));
    }
    let mut payload = vec![0u8; n];
    from.read_exact(&mut payload).await?;
    Ok((len, payload))
}

/// Writes a frame read by `read_frame` on to `to`, flushed.
async fn write_frame<W>(to: &mut W, len: &[u8; 4], payload: &[u8]) -> std::io::Result<()>
where
    W: tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::AsyncWriteExt as _;
    to.write_all(len).await?;
    to.write_all(payload).await?;
    to.flush().await
}

/// Copies frames from `from` to `to`, dropping those of type `kind`.
pub async fn drop_frames<R, W>(from: &mut R, to: &mut W, kind: &str) -> std::io::Result<()>
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    loop {
        let (len, payload) = read_frame(from).await?;
        if frame_type(&payload).as_deref() == Some(kind) {
            continue;
        }
        write_frame(to, &len, &payload).await?;
    }
}

fn frame_type(payload: &[u8]) -> Option<String> {
    serde_json::from_slice::<Value>(payload)
        .ok()?
        .get("type")?
        .as_str()
        .map(String::from)
}

/// Copies frames from `from` to `to`, holding each `started` frame while `hold` exists.
pub async fn relay_frames<R, W>(from: &mut R, to: &mut W, hold: &Path) -> std::io::Result<()>
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    loop {
        let (len, payload) = read_frame(from).await?;
        if is_started(&payload) {
            while hold.exists() {
                tokio::time::sleep(HOLD_POLL).await;
            }
        }
        write_frame(to, &len, &payload).await?;
    }
}

/// The frame is the guest's answer that a process started.
fn is_started(payload: &[u8]) -> bool {
    frame_type(payload).as_deref() == Some("started")
}

/// `yes > /dev/ttyS0`: lines of `y` at `rate` bytes a second, in 10 slices a second.
async fn flood(rate: u64) {
    const LINE: &str = "yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy";
    let per_tick = (rate / 10).max(1);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tick.tick().await;
        let mut out = std::io::stdout().lock();
        let mut written = 0;
        while written < per_tick {
            let _ = writeln!(out, "{LINE}");
            written += LINE.len() as u64 + 1;
        }
        let _ = out.flush();
    }
}

fn err_response((code, msg): Fault) -> Response {
    (code, axum::Json(json!({ "fault_message": msg }))).into_response()
}

/// Apply a `--config-file` (Firecracker's full VM configuration JSON) and start the VM.
fn apply_config_file(sim: &Sim, path: &Path) -> Result<(), String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("read {}: {e}", path.display()))?;
    let cfg: Map<String, Value> =
        serde_json::from_str(&text).map_err(|e| format!("config file: {e}"))?;
    let put = |route: &str, def: &str, param: Option<String>, v: &Value| -> Result<(), String> {
        let map = check_body(spec::definition(def), v.to_string().as_bytes())?;
        sim.put(route, param, map).map(|_| ()).map_err(|(_, m)| m)
    };
    if let Some(m) = cfg.get("machine-config") {
        put("/machine-config", "MachineConfiguration", None, m)?;
    }
    put(
        "/boot-source",
        "BootSource",
        None,
        cfg.get("boot-source")
            .ok_or("config file has no boot-source")?,
    )?;
    for d in cfg
        .get("drives")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        put(
            "/drives/{drive_id}",
            "Drive",
            d["drive_id"].as_str().map(String::from),
            d,
        )?;
    }
    for n in cfg
        .get("network-interfaces")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        put(
            "/network-interfaces/{iface_id}",
            "NetworkInterface",
            n["iface_id"].as_str().map(String::from),
            n,
        )?;
    }
    if let Some(v) = cfg.get("vsock") {
        put("/vsock", "Vsock", None, v)?;
    }
    put(
        "/actions",
        "InstanceActionInfo",
        None,
        &json!({"action_type": "InstanceStart"}),
    )
}

/// Run the simulator until the guest resets (Ok) or a setup error (Err, for stderr and exit 1).
/// Call inside a current-thread tokio runtime (see `spawn_agent`).
pub async fn run(opts: Options) -> Result<Exit, String> {
    if opts.knobs.crash_at_start {
        return Err("simulated crash at start (knob crash_at_start)".into());
    }
    let mut logger = Logger {
        id: opts.id.clone(),
        level: Level::Info,
        show_level: opts.show_level,
        file: None,
    };
    logger.configure(
        opts.log_path
            .as_deref()
            .map(|p| p.to_str().unwrap_or_default()),
        opts.log_level.as_deref(),
        None,
    )?;
    logger.log(
        Level::Info,
        LOG_THREAD_MAIN,
        &format!("Running {APP_NAME} v{VMM_VERSION}"),
    );
    let (tx, mut rx) = mpsc::unbounded_channel();
    let sim = Arc::new(Sim {
        id: opts.id,
        knobs: opts.knobs,
        guest_bin: opts.guest_bin,
        keeper_bin: opts.keeper_bin,
        vm: Mutex::new(Vm::default()),
        logger: Mutex::new(logger),
        exit: tx,
    });
    if let Some(cfg) = &opts.config_file {
        apply_config_file(&sim, cfg)?;
        boot_task(sim.clone());
    }
    if let Some(sock) = &opts.api_sock {
        tokio::time::sleep(Duration::from_millis(sim.knobs.api_delay_ms)).await;
        let listener = tokio::net::UnixListener::bind(sock)
            .map_err(|e| format!("bind API socket {}: {e}", sock.display()))?;
        let app = axum::Router::new().fallback(handle).with_state(sim.clone());
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
    }
    // The guest powering off (the agent exits, e.g. after Shutdown or a poweroff_on_exit
    // runner) resets the VM with imp.halt=reboot: Firecracker exits, so does the simulator.
    let watcher = sim.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let exited = watcher
                .vm
                .lock()
                .expect("vm lock")
                .agent
                .as_mut()
                .is_some_and(Guest::exited);
            if exited {
                serial("reboot: Restarting system");
                let _ = watcher.exit.send(Exit::GuestReset);
                return;
            }
        }
    });
    let exit = rx.recv().await.expect("the sender lives in `sim`");
    match exit {
        Exit::GuestReset => sim.log(
            Level::Info,
            LOG_THREAD_MAIN,
            "Firecracker exiting successfully. exit_code=0",
        ),
        Exit::RestoreFailed => sim.log(
            Level::Error,
            LOG_THREAD_MAIN,
            "Building VMM configured from cmdline json failed: Loading snapshot failed.",
        ),
    }
    let (agent, detached, identity) = {
        let mut vm = sim.vm.lock().expect("vm lock");
        (vm.agent.take(), vm.detached, vm.identity.take())
    };
    // A snapshotted guest stays with its keeper (this exit is the VMM stopping after it).
    if !detached {
        if let Some(agent) = agent {
            agent.kill();
        }
        if let Some(root) = identity {
            let _ = std::fs::remove_dir_all(root);
        }
    }
    if let Some(sock) = &opts.api_sock {
        let _ = std::fs::remove_file(sock);
    }
    Ok(exit)
}
