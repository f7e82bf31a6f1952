//! Checks on Prometheus expositions shared by every crate's metrics tests.

use crate::paths;

/// Asserts that every metric family in an OpenMetrics exposition is listed in docs/metrics.md
/// (counters under their `_total` sample name) and returns how many families there were, so a
/// caller can also pin the count.
pub fn assert_every_family_documented(exposition: &str) -> usize {
    let path = paths::workspace_root().join("docs/metrics.md");
    let docs =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let mut families = 0;
    for line in exposition.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        let family = line.split_whitespace().next().unwrap();
        let documented = if line.ends_with(" counter") {
            format!("{family}_total")
        } else {
            family.to_owned()
        };
        assert!(
            docs.contains(&format!("`{documented}`")),
            "{documented} is not in docs/metrics.md"
        );
        families += 1;
    }
    families
}
