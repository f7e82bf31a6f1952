//! Numbers the benches and the measuring tests share: a knob from the environment, the median and
//! a one-line summary of a series of seconds, and a process's resident memory.

/// The environment variable `name` as a number, or `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The median of `v` (the upper one of an even count).
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// "p50 S s (min, max, N runs)" of `v`, seconds with `decimals` places.
pub fn summary(v: &[f64], decimals: usize) -> String {
    let min = v.iter().cloned().fold(f64::MAX, f64::min);
    let max = v.iter().cloned().fold(0.0, f64::max);
    format!(
        "p50 {:.d$} s (min {min:.d$}, max {max:.d$}, {} runs)",
        median(v),
        v.len(),
        d = decimals
    )
}

/// VmRSS of `pid` in KiB (0 when it cannot be read).
pub fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}
