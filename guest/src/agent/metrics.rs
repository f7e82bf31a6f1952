//! `Metrics`: memory from /proc/meminfo, disk from statvfs("/"), uptime from /proc/uptime.

use std::path::Path;

use crate::protocol::GuestMetrics;

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("read {path}: {source}")]
    Read {
        path: &'static str,
        source: std::io::Error,
    },
    #[error("/proc/meminfo has no {0} line")]
    MeminfoField(&'static str),
    #[error("/proc/uptime is malformed")]
    Uptime,
    #[error("statvfs({path}): {source}")]
    Statvfs { path: String, source: nix::Error },
}

pub fn collect(root: &Path) -> Result<GuestMetrics, MetricsError> {
    let meminfo =
        std::fs::read_to_string("/proc/meminfo").map_err(|source| MetricsError::Read {
            path: "/proc/meminfo",
            source,
        })?;
    let (memory_total_bytes, memory_used_bytes) = parse_meminfo(&meminfo)?;
    let uptime = std::fs::read_to_string("/proc/uptime").map_err(|source| MetricsError::Read {
        path: "/proc/uptime",
        source,
    })?;
    let uptime_seconds = parse_uptime(&uptime)?;
    let vfs = nix::sys::statvfs::statvfs(root).map_err(|source| MetricsError::Statvfs {
        path: root.display().to_string(),
        source,
    })?;
    let frsize = vfs.fragment_size() as u64;
    let disk_total_bytes = vfs.blocks() as u64 * frsize;
    let disk_used_bytes = (vfs.blocks() as u64).saturating_sub(vfs.blocks_free() as u64) * frsize;
    Ok(GuestMetrics {
        memory_total_bytes,
        memory_used_bytes,
        disk_total_bytes,
        disk_used_bytes,
        uptime_seconds,
    })
}

/// (total, used) bytes, used = MemTotal - MemAvailable. Kernels before 3.14 lack
/// MemAvailable; then MemFree + Buffers + Cached approximates it.
pub fn parse_meminfo(text: &str) -> Result<(u64, u64), MetricsError> {
    let field = |name: &str| {
        text.lines().find_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix(':')?;
            let kib: u64 = rest.split_whitespace().next()?.parse().ok()?;
            Some(kib * 1024)
        })
    };
    let total = field("MemTotal").ok_or(MetricsError::MeminfoField("MemTotal"))?;
    let available = match field("MemAvailable") {
        Some(a) => a,
        None => {
            let free = field("MemFree").ok_or(MetricsError::MeminfoField("MemFree"))?;
            free + field("Buffers").unwrap_or(0) + field("Cached").unwrap_or(0)
        }
    };
    Ok((total, total.saturating_sub(available)))
}

pub fn parse_uptime(text: &str) -> Result<f64, MetricsError> {
    text.split_whitespace()
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or(MetricsError::Uptime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_with_and_without_available() {
        let modern = "MemTotal:        2048000 kB\nMemFree:          100000 kB\nMemAvailable:    1024000 kB\n";
        assert_eq!(
            parse_meminfo(modern).unwrap(),
            (2048000 * 1024, 1024000 * 1024)
        );
        let old = "MemTotal: 1000 kB\nMemFree: 100 kB\nBuffers: 50 kB\nCached: 250 kB\n";
        assert_eq!(parse_meminfo(old).unwrap(), (1000 * 1024, 600 * 1024));
        assert!(matches!(
            parse_meminfo("MemFree: 1 kB\n"),
            Err(MetricsError::MeminfoField("MemTotal"))
        ));
        // A prefix must not match a longer field name.
        assert!(parse_meminfo("MemTotalX: 5 kB\nMemFree: 1 kB\n").is_err());
    }

    #[test]
    fn uptime() {
        assert_eq!(parse_uptime("12.50 40.00\n").unwrap(), 12.5);
        assert!(parse_uptime("").is_err());
    }

    #[test]
    fn live_metrics_are_consistent() {
        let m = collect(Path::new("/")).unwrap();
        assert!(m.memory_total_bytes > 0 && m.memory_used_bytes <= m.memory_total_bytes);
        assert!(m.disk_total_bytes > 0 && m.disk_used_bytes <= m.disk_total_bytes);
        assert!(m.uptime_seconds > 0.0);
    }
}
