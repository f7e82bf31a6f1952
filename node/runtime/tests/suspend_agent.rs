//! Suspend, resume and ScaleToZero end to end (docs/suspend.md, "The agent: phases and
//! ScaleToZero"): the real `imp-agent` binary against a real kube-apiserver (testkit TestEnv),
//! the real `imp-runtime` binary with the Firecracker simulator, and a real OCI registry. The
//! test plays the operator (binding, IPAM annotation, finalizer).
//!
//! ScaleToZero runs inside network namespaces the test creates: imp-runtime (its bridge, TAPs
//! and nft tables) in a node namespace, the client in an "internet" namespace routed through it.
//! The simulator has no NIC: its process only holds the VM's TAP. [`GuestNic`] gives the guest
//! one that lives exactly as long as the VMM process: it takes a duplicate of the simulator's
//! TAP descriptor (pidfd_getfd) and relays frames to a TAP in a guest namespace holding the VM's
//! MAC and address, where a TCP listener answers. When the runtime suspends the VM its VMM
//! process ends, the relay lets go of the TAP and the guest is unreachable, as a suspended
//! Firecracker guest is; the restored VMM opens the TAP again and the relay re-attaches. The
//! client's packets take the node's real forwarding path (routed out the bridge to the TAP),
//! the path imp-runtime's wake counter counts. Wake-on-traffic is not hardware-validated.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use common::agent::{
    Agent, World, cond, idle_suspends_all_woken, pair, phase_of, ping_from, sample, tail,
};
use common::scale_to_zero::{GATEWAY, NETWORK, VM_IP, admitting_network, node_state, vm_addr};
use common::{Harness, TestNetwork, in_netns, ip};
use imp_api::names::{self, condition, reason};
use imp_api::{DesiredState, ImpNetwork, ImpVM, VmPhase};
use imp_runtime::api::VmState;
use imp_testkit::fixtures;
use kube::ResourceExt;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

impl World {
    fn agent(&self, n: u32, extra_env: &[(&str, &str)]) -> Agent {
        Agent::start(&self.env, &self.rt, &self.node, n, extra_env)
    }

    /// Creates `vm` (bound here, with the operator's finalizer) and leaves it Scheduled, as the
    /// operator does. `Err` with the API server's refusal.
    async fn create(&self, vm: fixtures::VmBuilder) -> Result<ImpVM, kube::Error> {
        let vm = vm
            .class(&self.class)
            .image(&self.image)
            .bound(&self.node)
            .finalizer(names::FINALIZER_VM_CLEANUP)
            .build();
        let name = vm.name_any();
        self.vms().create(&PostParams::default(), &vm).await?;
        Ok(self
            .set_status(&name, json!({"phase": VmPhase::Scheduled}))
            .await)
    }

    async fn set_desired(&self, name: &str, d: DesiredState) {
        self.vms()
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"desiredState": d}})),
            )
            .await
            .unwrap();
    }

    /// Waits for an Event on `name` of `type_` with `reason`; returns its note.
    async fn wait_event(&self, name: &str, type_: &str, reason: &str) -> String {
        let what = format!("{type_} {reason}");
        let events = self
            .wait_event_where(name, &what, |t, r, _| t == type_ && r == reason)
            .await;
        events
            .into_iter()
            .find(|(t, r, _)| t == type_ && r == reason)
            .map(|(_, _, note)| note)
            .unwrap()
    }

    async fn runtime_state(&self, uid: &str) -> VmState {
        self.rt.client.inspect(uid).await.unwrap().state
    }
}

/// The guest agent answers Hello over the VM's vsock.
async fn guest_answers(rt: &Harness, uid: &str) -> String {
    let info = rt.client.vsock(uid).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let client = imp_guest::host::connect(&info.path, info.guest_agent_port, deadline)
        .await
        .unwrap_or_else(|e| panic!("the guest agent of {uid} does not answer: {e}"));
    client.hello().boot_id.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn desired_suspended_suspends_and_running_resumes_with_the_guest_answering() {
    let w = World::new("suspend-req").await;
    let agent = w.agent(1, &[]);
    let vm = w.create(fixtures::vm("keeper").persistent()).await.unwrap();
    let uid = vm.uid().unwrap();
    w.wait_phase("keeper", VmPhase::Running, Duration::from_secs(60), &agent)
        .await;
    let boot_before = guest_answers(&w.rt, &uid).await;

    w.set_desired("keeper", DesiredState::Suspended).await;
    let asked = Instant::now();
    let vm = w
        .wait_phase(
            "keeper",
            VmPhase::Suspended,
            Duration::from_secs(60),
            &agent,
        )
        .await;
    let suspend_secs = asked.elapsed().as_secs_f64();
    assert_eq!(
        cond(&vm, condition::SUSPENDED),
        pair("True", reason::SUSPEND_REQUESTED)
    );
    assert_eq!(
        cond(&vm, condition::READY),
        pair("False", reason::VM_SUSPENDED)
    );
    assert_eq!(w.runtime_state(&uid).await, VmState::Suspended);
    assert!(
        w.rt.vmm_processes().is_empty(),
        "a suspended VM has no VMM process: {:?}",
        w.rt.vmm_processes()
    );
    w.wait_event("keeper", "Normal", reason::SUSPEND_REQUESTED)
        .await;
    let note = w.wait_event("keeper", "Normal", reason::VM_SUSPENDED).await;
    assert!(note.starts_with("suspended in "), "{note}");
    // It stays suspended: nothing resumes it by itself.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let still = w.vms().get("keeper").await.unwrap();
    assert_eq!(phase_of(&still), Some(VmPhase::Suspended));

    w.set_desired("keeper", DesiredState::Running).await;
    let asked = Instant::now();
    let vm = w
        .wait_phase("keeper", VmPhase::Running, Duration::from_secs(60), &agent)
        .await;
    let resume_secs = asked.elapsed().as_secs_f64();
    assert_eq!(
        cond(&vm, condition::SUSPENDED),
        pair("False", reason::RESUME_REQUESTED)
    );
    assert_eq!(
        cond(&vm, condition::READY),
        pair("True", reason::GUEST_READY)
    );
    assert_eq!(w.runtime_state(&uid).await, VmState::Running);
    let boot_after = guest_answers(&w.rt, &uid).await;
    assert_eq!(
        boot_before, boot_after,
        "restored, not rebooted: the same boot id"
    );
    w.wait_event("keeper", "Normal", reason::RESUME_REQUESTED)
        .await;
    let note = w.wait_event("keeper", "Normal", reason::VM_RESUMED).await;
    assert!(note.starts_with("resumed in "), "{note}");
    let m = agent.metrics();
    assert_eq!(
        sample(&m, "imp_agent_vm_suspends_total{trigger=\"requested\"}"),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        sample(&m, "imp_agent_vm_resumes_total{trigger=\"requested\"}"),
        Some(1.0),
        "{m}"
    );
    println!(
        "desiredState Suspended -> phase Suspended {suspend_secs:.2}s, Running -> Running {resume_secs:.2}s \
         (API writes, 500 ms agent poll); guest boot id {} across the resume",
        if boot_before == boot_after {
            "kept"
        } else {
            "changed"
        }
    );

    // An ephemeral VM is never suspended: refused by the API server (admission) or, if the
    // server lets it through, by the agent with a condition and a Warning Event.
    let eph = w
        .create(
            fixtures::vm("oneshot")
                .ephemeral()
                .desired(DesiredState::Suspended),
        )
        .await;
    match eph {
        Err(kube::Error::Api(s)) => {
            assert!(s.code == 422 || s.code == 400, "{s:?}");
            println!(
                "the API server refused an ephemeral Suspended VM: {}",
                s.message
            );
        }
        Err(e) => panic!("{e}"),
        Ok(eph) => {
            let vm = w
                .wait_vm(
                    "oneshot",
                    "refused",
                    Duration::from_secs(60),
                    &agent,
                    |vm| {
                        cond(vm, condition::SUSPENDED) == pair("False", reason::SUSPEND_NOT_ALLOWED)
                    },
                )
                .await;
            assert_eq!(phase_of(&vm), Some(VmPhase::Running));
            assert_eq!(w.runtime_state(&eph.uid().unwrap()).await, VmState::Running);
            w.wait_event("oneshot", "Warning", reason::SUSPEND_NOT_ALLOWED)
                .await;
        }
    }
    drop(agent);
    w.finish().await;
}

// ---------------------------------------------------------------------------------------------
// ScaleToZero in network namespaces.

/// The VMM process holding TAP `tap` open, and the descriptor number there (/proc fdinfo of a
/// tun descriptor names its interface: `iff:\t<name>`).
fn tap_holder(rt_vms: &Path, tap: &str) -> Option<(i32, i32)> {
    let want = format!("iff:\t{tap}\n");
    for (pid, _, _) in imp_runtime::procfs::firecrackers_under(rt_vms) {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
            continue;
        };
        for e in fds.flatten() {
            let Ok(text) = std::fs::read_to_string(e.path()) else {
                continue;
            };
            if text.contains(&want)
                && let Some(n) = e.file_name().to_str().and_then(|s| s.parse().ok())
            {
                return Some((pid, n));
            }
        }
    }
    None
}

/// (pidfd of `pid`, a duplicate of its descriptor `fd`).
fn grab(pid: i32, fd: i32) -> std::io::Result<(OwnedFd, OwnedFd)> {
    // SAFETY: plain syscalls; the returned descriptors are new and ours.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    let dup = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if dup < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((pidfd, unsafe { OwnedFd::from_raw_fd(dup as i32) }))
}

/// Copies one frame from `from` to `to`; false when `from` failed (the TAP went away).
fn pass(from: &OwnedFd, to: &OwnedFd, buf: &mut [u8]) -> bool {
    // SAFETY: reads into / writes from a buffer we own.
    let n = unsafe { libc::read(from.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    if n <= 0 {
        return false;
    }
    unsafe { libc::write(to.as_raw_fd(), buf.as_ptr().cast(), n as usize) };
    true
}

/// The simulated guest's NIC: a TAP `g0` in namespace `ns` (the VM's MAC and address, a
/// default route via the gateway) whose frames are relayed to and from the VM's host TAP
/// through a duplicate of the VMM process's own TAP descriptor, for as long as that process
/// lives. No VMM, no NIC: what reaches the host TAP then is lost, as for a suspended VM.
struct GuestNic {
    ns: String,
    stop: Arc<AtomicBool>,
    /// How many VMM processes the relay attached to (boot, then one per resume).
    attaches: Arc<AtomicU32>,
    attached: Arc<AtomicBool>,
    relay: Option<std::thread::JoinHandle<()>>,
}

impl GuestNic {
    fn new(ns: &str, rt: &Harness, uid: &str) -> GuestNic {
        ip(&["netns", "add", ns]);
        ip(&["-n", ns, "link", "set", "lo", "up"]);
        // No IPv6 chatter from the guest: it would count as traffic and keep it awake.
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                ns,
                "sysctl",
                "-qw",
                "net.ipv6.conf.all.disable_ipv6=1",
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        // The simulator's own TAP open (TUNSETIFF creates the TAP when it is missing).
        let guest = in_netns(ns, || {
            imp_testkit::firecracker::sim::open_tap("g0").map(OwnedFd::from)
        })
        .expect("guest TAP");
        let mac = imp_runtime::network::format_mac(&imp_runtime::network::vm_mac(uid));
        ip(&["-n", ns, "link", "set", "g0", "address", &mac]);
        ip(&["-n", ns, "addr", "add", &format!("{VM_IP}/24"), "dev", "g0"]);
        ip(&["-n", ns, "link", "set", "g0", "up"]);
        ip(&["-n", ns, "route", "add", "default", "via", GATEWAY]);
        let stop = Arc::new(AtomicBool::new(false));
        let attaches = Arc::new(AtomicU32::new(0));
        let attached = Arc::new(AtomicBool::new(false));
        let (vms, tap) = (rt.vms_dir(), rt.tap_for(uid));
        let (s, a, on) = (stop.clone(), attaches.clone(), attached.clone());
        let relay = std::thread::spawn(move || relay(&vms, &tap, guest, &s, &a, &on));
        GuestNic {
            ns: ns.to_owned(),
            stop,
            attaches,
            attached,
            relay: Some(relay),
        }
    }

    /// A TCP listener on the guest's address answering each line with `pong <line>`.
    fn serve(&self) {
        let listener = in_netns(&self.ns, || TcpListener::bind(vm_addr()).unwrap());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut c) = conn else { return };
                std::thread::spawn(move || {
                    let mut line = String::new();
                    if BufReader::new(c.try_clone().unwrap())
                        .read_line(&mut line)
                        .is_ok()
                    {
                        let _ = c.write_all(format!("pong {line}").as_bytes());
                    }
                });
            }
        });
    }

    fn attaches(&self) -> u32 {
        self.attaches.load(Ordering::SeqCst)
    }

    fn attached(&self) -> bool {
        self.attached.load(Ordering::SeqCst)
    }
}

fn relay(
    vms: &Path,
    tap: &str,
    guest: OwnedFd,
    stop: &AtomicBool,
    attaches: &AtomicU32,
    attached: &AtomicBool,
) {
    let mut buf = vec![0u8; 65536];
    let poll = |fds: &mut [libc::pollfd], ms: i32| {
        // SAFETY: fds is a live slice of pollfd.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) }
    };
    while !stop.load(Ordering::SeqCst) {
        let held = tap_holder(vms, tap).and_then(|(pid, fd)| grab(pid, fd).ok());
        let Some((pidfd, host)) = held else {
            // No VMM: what the guest sends goes nowhere.
            let mut fds = [libc::pollfd {
                fd: guest.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            if poll(&mut fds, 20) > 0 {
                let _ =
                    unsafe { libc::read(guest.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            }
            continue;
        };
        attaches.fetch_add(1, Ordering::SeqCst);
        attached.store(true, Ordering::SeqCst);
        while !stop.load(Ordering::SeqCst) {
            let mut fds =
                [host.as_raw_fd(), guest.as_raw_fd(), pidfd.as_raw_fd()].map(|fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                });
            if poll(&mut fds, 50) <= 0 {
                continue;
            }
            // The VMM ended (suspended, stopped): its NIC goes with it.
            if fds[2].revents != 0 || fds[0].revents & (libc::POLLERR | libc::POLLHUP) != 0 {
                break;
            }
            if fds[0].revents & libc::POLLIN != 0 && !pass(&host, &guest, &mut buf) {
                break;
            }
            if fds[1].revents & libc::POLLIN != 0 {
                pass(&guest, &host, &mut buf);
            }
        }
        attached.store(false, Ordering::SeqCst);
    }
}

impl Drop for GuestNic {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(r) = self.relay.take() {
            let _ = r.join();
        }
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_to_zero_needs_the_flag_then_idle_suspends_and_a_client_connection_wakes_it() {
    if !common::network_tests_can_run() {
        return;
    }
    // Declared first: dropped last (after the world's runtime and VMMs).
    let tn = TestNetwork::new("impsz");
    let w = World::new_in("scale-to-zero", Some(&tn)).await;
    admitting_network(&w.env, &tn).await;

    // First an agent without IMP_SCALE_TO_ZERO: the VM runs and says why it does not sleep.
    let agent = w.agent(1, &[]);
    let vm = w
        .create(
            fixtures::vm("sleepy")
                .persistent()
                .network(NETWORK)
                .desired(DesiredState::ScaleToZero)
                .idle_timeout("10s"),
        )
        .await
        .unwrap();
    let uid = vm.uid().unwrap();
    let nic = GuestNic::new(&format!("impsz-guest-{}", std::process::id()), &w.rt, &uid);
    nic.serve();
    w.vms()
        .patch(
            "sleepy",
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"annotations": {
                names::ANNOTATION_IP_ALLOCATION: format!("{VM_IP}/24")}}})),
        )
        .await
        .unwrap();
    w.wait_phase("sleepy", VmPhase::Running, Duration::from_secs(60), &agent)
        .await;
    let running_at = Instant::now();
    let vm = w
        .wait_vm(
            "sleepy",
            reason::SCALE_TO_ZERO_DISABLED,
            Duration::from_secs(30),
            &agent,
            |vm| cond(vm, condition::SUSPENDED) == pair("False", reason::SCALE_TO_ZERO_DISABLED),
        )
        .await;
    assert_eq!(phase_of(&vm), Some(VmPhase::Running));
    w.wait_event("sleepy", "Warning", reason::SCALE_TO_ZERO_DISABLED)
        .await;
    common::wait_until("the guest NIC attached", Duration::from_secs(10), || {
        nic.attached()
    })
    .await;
    // The node reaches the guest (the relay and the guest's stack work)...
    let (answer, _) = ping_from(&tn.node, vm_addr(), Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("node -> running VM: {e}"));
    assert_eq!(answer, "pong ping\n");
    // ...and so does the client routed through the node, which spec.ingress admits.
    let (answer, took) = ping_from(&tn.inet, vm_addr(), Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("client -> running VM: {e}\n{}", node_state(&tn)));
    assert_eq!(answer, "pong ping\n");
    println!(
        "client -> running VM: {:.1} ms",
        took.as_secs_f64() * 1000.0
    );
    // Idle well past idleTimeout: still Running, the runtime too.
    tokio::time::sleep(Duration::from_secs(13).saturating_sub(running_at.elapsed())).await;
    let vm = w.vms().get("sleepy").await.unwrap();
    assert_eq!(phase_of(&vm), Some(VmPhase::Running), "{:#?}", vm.status);
    assert_eq!(w.runtime_state(&uid).await, VmState::Running);
    assert!(
        !agent.metrics().contains("imp_agent_vm_suspends_total{"),
        "suspended without IMP_SCALE_TO_ZERO"
    );
    drop(agent);

    // Now with IMP_SCALE_TO_ZERO=true: the notice goes, the idle clock starts.
    let agent = w.agent(2, &[("IMP_SCALE_TO_ZERO", "true")]);
    let (_, took) = ping_from(&tn.node, vm_addr(), Duration::from_secs(10)).unwrap();
    let last_traffic = Instant::now() - took;
    let vm = w
        .wait_phase(
            "sleepy",
            VmPhase::Suspended,
            Duration::from_secs(60),
            &agent,
        )
        .await;
    let idle = last_traffic.elapsed();
    assert!(
        idle >= Duration::from_secs(10),
        "suspended {idle:?} after the last traffic (idleTimeout 10s)"
    );
    assert_eq!(
        cond(&vm, condition::SUSPENDED),
        pair("True", reason::IDLE_TIMEOUT)
    );
    assert_eq!(w.runtime_state(&uid).await, VmState::Suspended);
    w.wait_event("sleepy", "Normal", reason::IDLE_TIMEOUT).await;
    common::wait_until(
        "the guest NIC gone with its VMM",
        Duration::from_secs(10),
        || !nic.attached(),
    )
    .await;
    let attaches_before = nic.attaches();
    // Stays asleep without traffic.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        phase_of(&w.vms().get("sleepy").await.unwrap()),
        Some(VmPhase::Suspended)
    );
    let stats = w.rt.client.linkstats(&uid).await.unwrap();
    assert_eq!(stats.wake_packets, 0, "{stats:?}");

    // A client connects: its SYN is forwarded towards the VM and counted, the agent resumes
    // the VM, and a retransmitted SYN reaches the restored guest.
    let client_ns = tn.inet.clone();
    let within = Duration::from_secs(45);
    let sent = Instant::now();
    let client = std::thread::spawn(move || ping_from(&client_ns, vm_addr(), within));
    let vm = w
        .wait_phase("sleepy", VmPhase::Running, Duration::from_secs(45), &agent)
        .await;
    let woke_after = sent.elapsed();
    let outcome = client.join().unwrap();
    let (answer, took) = outcome.unwrap_or_else(|e| {
        panic!(
            "client -> suspended VM: {e}\nagent log tail:\n{}\n{}",
            tail(&agent.log(), 60),
            node_state(&tn)
        )
    });
    assert_eq!(answer, "pong ping\n");
    assert_eq!(
        cond(&vm, condition::SUSPENDED),
        pair("False", reason::WOKEN_BY_TRAFFIC)
    );
    assert_eq!(
        cond(&vm, condition::READY),
        pair("True", reason::GUEST_READY)
    );
    assert_eq!(w.runtime_state(&uid).await, VmState::Running);
    assert!(
        nic.attaches() > attaches_before,
        "the answer came through a new VMM's TAP"
    );
    w.wait_event("sleepy", "Normal", reason::WOKEN_BY_TRAFFIC)
        .await;
    let note = w.wait_event("sleepy", "Normal", reason::VM_RESUMED).await;
    let m = agent.metrics();
    let wake = idle_suspends_all_woken(&m);
    println!(
        "ScaleToZero: suspended {:.1}s after the last traffic (idleTimeout 10s); client SYN -> phase \
         Running {:.2}s (wake seen -> Running {wake:.2}s; {note}); first answer from the resumed \
         guest in {:.3}s (the client's exchange, from its first SYN)",
        idle.as_secs_f64(),
        woke_after.as_secs_f64(),
        took.as_secs_f64(),
    );
    drop(agent);
    drop(nic);
    let _ = w
        .env
        .api::<ImpNetwork>()
        .delete(NETWORK, &DeleteParams::default())
        .await;
    w.finish().await;
}
