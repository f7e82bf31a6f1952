//! kill -9 of imp-runtime before InstanceStart, during boot and after Hello; the restarted
//! runtime reattaches running VMs, cleans half-made ones and kills only its own orphans.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{Harness, alive, backends, is_root, wait_until};
use imp_api::names::reason;
use imp_runtime::api::VmState;
use imp_testkit::firecracker::Knobs;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_restart_reattaches_running_and_cleans_half_made() {
    for backend in backends("kill9_restart_reattaches_running_and_cleans_half_made") {
        let sim = backend.is_simulator();
        let mut h = Harness::new(backend);
        // Slow VMM start (runtime killed before InstanceStart) and slow boot (killed during boot).
        h.knobs(
            "pre-start",
            Knobs {
                api_delay_ms: 60_000,
                ..Knobs::default()
            },
        );
        h.knobs(
            "booting",
            Knobs {
                boot_delay_ms: 60_000,
                ..Knobs::default()
            },
        );
        h.start_runtime().await;
        let network = is_root();

        // "running" stays up across the restart; "dies" loses its process while the runtime is down.
        let running = h
            .client
            .ensure_running("running", &h.spec(network))
            .await
            .unwrap()
            .1;
        let dies = h
            .client
            .ensure_running("dies", &h.spec(false))
            .await
            .unwrap()
            .1;
        let (rpid, dpid) = (running.pid.unwrap(), dies.pid.unwrap());
        let rstart = imp_runtime::procfs::start_time(rpid).unwrap();
        let dstart = imp_runtime::procfs::start_time(dpid).unwrap();

        let mut half_made = Vec::new();
        if sim {
            for uid in ["pre-start", "booting"] {
                let c = h.client.clone();
                let spec = h.spec(network);
                tokio::spawn(async move {
                    let _ = c.ensure_running(uid, &spec).await;
                });
            }
            // Wait until each is where we want to kill the runtime.
            for (uid, state) in [
                ("pre-start", VmState::Creating),
                ("booting", VmState::Booting),
            ] {
                let deadline = std::time::Instant::now() + Duration::from_secs(15);
                loop {
                    if let Ok(st) = h.client.inspect(uid).await
                        && st.state == state
                        && st.pid.is_some()
                    {
                        half_made.push((
                            uid,
                            st.pid.unwrap(),
                            imp_runtime::procfs::start_time(st.pid.unwrap()).unwrap(),
                        ));
                        break;
                    }
                    assert!(
                        std::time::Instant::now() < deadline,
                        "{uid} never reached {state:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        // An orphan: a VMM under our state dir that no row knows (spawned just before a crash).
        // And a bystander: a VMM of another state dir, which must survive.
        let (mut orphan, mut bystander, other_dir) =
            if let common::Backend::Simulator { simulator, guest } = &h.backend {
                let orphan_dir = h.vms_dir().join("orphan");
                std::fs::create_dir_all(&orphan_dir).unwrap();
                let other = tempfile::tempdir().unwrap();
                let spawn = |sock: std::path::PathBuf| {
                    Command::new(simulator)
                        .arg("--api-sock")
                        .arg(sock)
                        .arg("--id")
                        .arg("x")
                        .env("IMP_GUEST_BIN", guest)
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()
                        .unwrap()
                };
                (
                    Some(spawn(orphan_dir.join("api.sock"))),
                    Some(spawn(other.path().join("api.sock"))),
                    Some(other),
                )
            } else {
                (None, None, None)
            };

        h.kill9_runtime();
        // The VMs outlive the runtime.
        assert!(alive(rpid, rstart), "running VM died with the runtime");
        for (uid, pid, start) in &half_made {
            assert!(alive(*pid, *start), "{uid} died with the runtime");
        }
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(dpid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        wait_until("dies' process gone", Duration::from_secs(5), || {
            !alive(dpid, dstart)
        })
        .await;

        h.start_runtime().await;

        // Reattached: same process, still Running, guest still answers, linkstats still work.
        let st = h.client.inspect("running").await.unwrap();
        assert_eq!((st.state, st.pid), (VmState::Running, Some(rpid)));
        assert!(alive(rpid, rstart));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        imp_guest::host::connect(
            &st.vsock_path,
            imp_guest::protocol::AGENT_VSOCK_PORT,
            deadline,
        )
        .await
        .unwrap();
        if network {
            h.client.linkstats("running").await.unwrap();
        }
        // A second PUT after the restart does not start another process.
        let (code, again) = h
            .client
            .ensure_running("running", &h.spec(network))
            .await
            .unwrap();
        assert_eq!((code.as_u16(), again.pid), (200, Some(rpid)));

        // The VM whose process died is marked, not resurrected.
        assert_eq!(
            h.client.inspect("dies").await.unwrap().state,
            VmState::Exited
        );

        // Half-made VMs: process killed, TAP, files and row gone.
        for (uid, pid, start) in &half_made {
            assert!(!alive(*pid, *start), "{uid}'s process survived the cleanup");
            assert_eq!(
                h.client.inspect(uid).await.unwrap_err().reason(),
                Some(reason::NOT_FOUND),
                "{uid}"
            );
            assert!(
                !h.vms_dir().join(uid).exists(),
                "{uid}'s directory survived"
            );
            assert!(
                !imp_runtime::tap::exists(&h.tap_for(uid)).unwrap(),
                "{uid}'s TAP survived"
            );
        }
        if let (Some(o), Some(b)) = (orphan.as_mut(), bystander.as_mut()) {
            let status = tokio::time::timeout(Duration::from_secs(5), async {
                loop {
                    if let Some(s) = o.try_wait().unwrap() {
                        return s;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
            .await
            .expect("orphan VMM killed");
            assert!(!status.success());
            assert!(
                !h.vms_dir().join("orphan").exists(),
                "orphan directory removed"
            );
            assert!(
                b.try_wait().unwrap().is_none(),
                "a VMM of another state dir must not be touched"
            );
            b.kill().unwrap();
            b.wait().unwrap();
        }
        drop(other_dir);
        let m = h.metrics().await;
        assert!(
            m.contains("imp_runtime_recovered_vms_total{outcome=\"reattached\"} 1"),
            "{m}"
        );
        assert!(
            m.contains("imp_runtime_recovered_vms_total{outcome=\"exited\"} 1"),
            "{m}"
        );
        if sim {
            assert!(
                m.contains("imp_runtime_recovered_vms_total{outcome=\"cleaned\"} 2"),
                "{m}"
            );
        }
        if orphan.is_some() {
            assert!(
                m.contains("imp_runtime_recovered_vms_total{outcome=\"orphan_killed\"} 1"),
                "{m}"
            );
        }

        // The restarted runtime can start the cleaned uid afresh (now without knobs), then
        // everything is deleted: no process, socket, file or row remains.
        if sim {
            h.knobs("booting", Knobs::default());
            let st = h
                .client
                .ensure_running("booting", &h.spec(network))
                .await
                .unwrap()
                .1;
            assert_eq!(st.state, VmState::Running);
        }
        for st in h.client.list().await.unwrap() {
            h.client.delete(&st.uid).await.unwrap();
        }
        assert!(h.client.list().await.unwrap().is_empty(), "rows left");
        assert!(
            h.vmm_processes().is_empty(),
            "processes left: {:?}",
            h.vmm_processes()
        );
        assert_eq!(
            std::fs::read_dir(h.vms_dir()).unwrap().count(),
            0,
            "files left"
        );
        for uid in ["running", "dies", "pre-start", "booting"] {
            assert!(
                !imp_runtime::tap::exists(&h.tap_for(uid)).unwrap(),
                "TAP of {uid} left"
            );
        }
    }
}
