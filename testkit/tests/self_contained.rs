//! The repository tests on its own: no tracked file (code, scripts, Makefile, chart, docs) refers to the
//! shared directory beside the checkout, and every consumer's reference file is inside the repository.

use std::path::Path;
use std::process::Command;

use imp_testkit::paths;

/// Ways a file could reach outside the checkout for reference data. Built with `concat!` so this
/// file does not match itself.
const OUTSIDE: &[&str] = &[
    concat!("..", "/shared"),
    concat!("/work", "/shared"),
    concat!("shared", "/reference"),
];

fn tracked_files(root: &Path) -> Vec<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(["ls-files", "-z"])
        .output()
        .unwrap_or_else(|e| panic!("git ls-files in {}: cannot run git: {e}", root.display()));
    assert!(
        out.status.success(),
        "git ls-files in {}: {}",
        root.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("tracked paths are UTF-8")
        .split('\0')
        .filter(|p| !p.is_empty())
        .map(String::from)
        .collect()
}

#[test]
fn no_tracked_file_refers_to_the_shared_directory_beside_the_checkout() {
    let root = paths::workspace_root();
    let files = tracked_files(&root);
    assert!(
        files.iter().any(|f| f == "Makefile"),
        "git ls-files in {} did not list the Makefile",
        root.display()
    );
    let mut hits = Vec::new();
    for file in &files {
        // Binary files and files deleted in the work tree have nothing to say.
        let Ok(text) = std::fs::read_to_string(root.join(file)) else {
            continue;
        };
        for (n, line) in text.lines().enumerate() {
            if OUTSIDE.iter().any(|p| line.contains(p)) {
                hits.push(format!("{file}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        hits.is_empty(),
        "these lines read outside the repository (use testkit::paths::reference_dir()):\n{}",
        hits.join("\n")
    );
}

/// `*` matches any run of characters, as in the README's path column.
fn glob_matches(pattern: &str, path: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = path.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    for (i, part) in parts.iter().enumerate() {
        if i == parts.len() - 1 {
            return rest.ends_with(part);
        }
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.is_empty()
}

#[test]
fn glob_matching_follows_the_readme_patterns() {
    assert!(glob_matches("a/b.yaml", "a/b.yaml"));
    assert!(!glob_matches("a/b.yaml", "a/b.yaml.bak"));
    assert!(glob_matches(
        "w/x.*.payload.json",
        "w/x.queued.payload.json"
    ));
    assert!(!glob_matches(
        "w/x.*.payload.json",
        "w/x.queued.schema.json"
    ));
    assert!(glob_matches("s/*.yaml", "s/a.yaml"));
    assert!(!glob_matches("s/*.yaml", "t/a.yaml"));
}

#[test]
fn every_reference_file_has_its_origin_in_the_readme() {
    let root = paths::workspace_root();
    let dir = paths::reference_dir();
    let readme = std::fs::read_to_string(dir.join("README.md"))
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.join("README.md").display()));
    // The first cell of each table row below the header: a path or a `*` pattern.
    let patterns: Vec<&str> = readme
        .lines()
        .filter_map(|l| l.strip_prefix('|'))
        .filter_map(|l| l.split('|').next())
        .map(str::trim)
        .filter(|c| !c.is_empty() && *c != "Path" && !c.starts_with('-'))
        .collect();
    assert!(!patterns.is_empty(), "no table in {}", dir.display());
    let files: Vec<String> = tracked_files(&root)
        .into_iter()
        .filter_map(|f| f.strip_prefix("reference/").map(String::from))
        .filter(|f| f != "README.md")
        .collect();
    assert!(
        !files.is_empty(),
        "no tracked files under {}",
        dir.display()
    );
    let unnamed: Vec<&String> = files
        .iter()
        .filter(|f| !patterns.iter().any(|p| glob_matches(p, f)))
        .collect();
    assert!(
        unnamed.is_empty(),
        "reference files without a row (origin and licence) in reference/README.md: {unnamed:?}"
    );
}

/// A tracked symlink is part of the checkout only if it stays inside it: an absolute or escaping
/// target (e.g. a worktree's `testenv/bin` pointing at another checkout) would make a clone read, and
/// write, outside the repository.
#[test]
fn no_tracked_symlink_points_outside_the_checkout() {
    let root = paths::workspace_root();
    let mut escaping = Vec::new();
    for file in tracked_files(&root) {
        let path = root.join(&file);
        let Ok(target) = std::fs::read_link(&path) else {
            continue;
        };
        let parent = path.parent().expect("a tracked file has a parent");
        let inside = !target.is_absolute() && path_is_below(&root, &parent.join(&target));
        if !inside {
            escaping.push(format!("{file} -> {}", target.display()));
        }
    }
    assert!(
        escaping.is_empty(),
        "tracked symlinks that point outside the repository:\n{}",
        escaping.join("\n")
    );
}

/// Whether `path` (possibly with `..` parts, not resolved on disk) lies below `root`.
fn path_is_below(root: &Path, path: &Path) -> bool {
    let mut parts: Vec<std::ffi::OsString> = Vec::new();
    for c in path.components() {
        match c {
            std::path::Component::ParentDir => {
                parts.pop();
            }
            std::path::Component::Normal(p) => parts.push(p.to_owned()),
            std::path::Component::RootDir => parts.clear(),
            _ => {}
        }
    }
    let normal: std::path::PathBuf = std::iter::once(std::ffi::OsString::from("/"))
        .chain(parts)
        .collect();
    normal.starts_with(root)
}
