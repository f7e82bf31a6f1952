//! One way for a test to skip: a `SKIPPED` line naming what did not run, why, and the `IMP_REQUIRE_*`
//! variable that turns the skip into a failure. The line also goes to the file `IMP_SKIP_LOG` names
//! (`.ci/run` sets it): cargo test hides a passing test's output, and `.ci/skips.sh` must see every
//! skip of a run to fail on those of components CI installed.

use std::io::Write;

/// The line a skip prints (and `.ci/skips.sh` parses).
pub fn line(var: &str, what: &str, why: &str) -> String {
    format!("SKIPPED {what}: {why} ({var}=1 makes this a failure)")
}

/// Whether `var` is set to `1`.
pub fn required(var: &str) -> bool {
    std::env::var(var).as_deref() == Ok("1")
}

/// Skips `what` for `why`: panics when `var` is `1`, else prints and records the `SKIPPED` line.
/// Callers return after it.
pub fn skip_or_fail(var: &str, what: &str, why: &str) {
    assert!(!required(var), "{var}=1 but {what} cannot run: {why}");
    let line = line(var, what, why);
    println!("{line}");
    eprintln!("{line}");
    if let Some(path) = std::env::var_os("IMP_SKIP_LOG") {
        // Appends are atomic for a line this short, so parallel tests do not interleave.
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_names_the_variable_that_makes_it_a_failure() {
        assert_eq!(
            line("IMP_REQUIRE_QEMU", "the QEMU path", "no qemu-system-x86_64"),
            "SKIPPED the QEMU path: no qemu-system-x86_64 (IMP_REQUIRE_QEMU=1 makes this a failure)"
        );
    }
}
