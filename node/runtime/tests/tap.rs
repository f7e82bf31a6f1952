//! The TAP helpers (imp_runtime::tap) on real kernel networking, inside a network namespace this test
//! creates, entered the way `nsenter --net` does (setns on a thread, sysfs left as it was): every
//! check must see the namespace's links, not the host's. The smoke found TAPs left behind when the
//! helpers read /sys/class/net, which still showed the host's links there.
//!
//! Needs root and iproute2; skips with a message otherwise, and fails instead under IMP_REQUIRE_ROOT=1.

use std::process::Command;

use imp_runtime::tap;

/// The namespace, deleted on drop (also when an assertion fails), taking its links with it.
struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn host_has_link(name: &str) -> bool {
    Command::new("ip")
        .args(["link", "show", "dev", name])
        .output()
        .unwrap()
        .status
        .success()
}

#[test]
fn tap_lifecycle_sees_the_namespace_it_runs_in_not_sysfs() {
    let root = nix::unistd::geteuid().is_root();
    if !root || Command::new("ip").arg("-V").output().is_err() {
        let why = "needs root and iproute2";
        return imp_testkit::skip::skip_or_fail("IMP_REQUIRE_ROOT", "tap_lifecycle", why);
    }
    let ns = Netns(format!("impt-tap-{}", std::process::id()));
    assert!(
        Command::new("ip")
            .args(["netns", "add", &ns.0])
            .status()
            .unwrap()
            .success()
    );
    let name = format!("imptap{}", std::process::id() % 100_000);
    // Run `f` on a thread that entered the namespace (setns is per thread; `ip` children inherit it).
    let in_ns = |f: &(dyn Fn(&str) + Sync)| {
        std::thread::scope(|s| {
            s.spawn(|| {
                let fd = std::fs::File::open(format!("/run/netns/{}", ns.0)).unwrap();
                nix::sched::setns(fd, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
                f(&name)
            })
            .join()
            .expect("the TAP checks failed in the namespace")
        })
    };
    in_ns(&|name| {
        assert!(!tap::exists(name).unwrap());
        tap::create(name).unwrap();
        tap::create(name).expect("create is idempotent");
        assert!(tap::exists(name).unwrap());
        let stats = tap::stats(name).unwrap();
        assert_eq!(stats.rx_bytes, 0, "nothing has sent on a fresh TAP");
    });
    assert!(
        !host_has_link(&name),
        "the TAP was created in the host namespace"
    );
    in_ns(&|name| {
        tap::delete(name).unwrap();
        assert!(!tap::exists(name).unwrap(), "delete left the TAP");
        tap::delete(name).expect("deleting an absent TAP is fine");
        assert!(matches!(
            tap::stats(name),
            Err(tap::TapError::NoSuchLink(_))
        ));
    });
    assert!(!host_has_link(&name));
}
