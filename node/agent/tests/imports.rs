//! The agent's modules import downward only: no import circle between its files, and no module
//! imports the one that spawns its tasks (the controller). Read from the sources, so a new
//! `use super::controller` in a task module, or any circle, fails here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module -> the crate modules it names (`super::x`, `crate::x`, in `use` lists too), comments
/// and the unit-test module left out (`use super::*` there is the module itself).
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files: BTreeMap<String, String> = std::fs::read_dir(&src)
        .expect("reading src/")
        .filter_map(|e| {
            let p = e.ok()?.path();
            let name = p.file_stem()?.to_str()?.to_owned();
            (p.extension()? == "rs").then(|| (name, std::fs::read_to_string(&p).unwrap()))
        })
        .collect();
    let mods: BTreeSet<&str> = files.keys().map(String::as_str).collect();
    files
        .iter()
        .map(|(m, text)| {
            let code = text
                .split("#[cfg(test)]\nmod tests")
                .next()
                .unwrap_or_default();
            let code: String = code
                .lines()
                .map(|l| l.split("//").next().unwrap_or_default())
                .collect::<Vec<_>>()
                .join("\n");
            let mut deps = BTreeSet::new();
            for prefix in ["super::", "crate::"] {
                for (i, _) in code.match_indices(prefix) {
                    let rest = &code[i + prefix.len()..];
                    // `super::{a, b::c}` names several modules.
                    let names: Vec<&str> = match rest.strip_prefix('{') {
                        Some(list) => list
                            .split('}')
                            .next()
                            .unwrap_or_default()
                            .split(',')
                            .collect(),
                        None => vec![rest],
                    };
                    for n in names {
                        let n = n.trim();
                        let end = n
                            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                            .unwrap_or(n.len());
                        if mods.contains(&n[..end]) && &n[..end] != m {
                            deps.insert(n[..end].to_owned());
                        }
                    }
                }
            }
            (m.clone(), deps)
        })
        .collect()
}

#[test]
fn no_module_imports_in_a_circle() {
    let g = graph();
    assert!(
        g.contains_key("controller") && g.contains_key("context"),
        "{g:?}"
    );
    // Depth-first search; `lib` only wires (it declares every module and imports none back).
    fn visit<'a>(
        g: &'a BTreeMap<String, BTreeSet<String>>,
        m: &'a str,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) {
        if let Some(i) = path.iter().position(|p| *p == m) {
            panic!("import circle: {} -> {m}", path[i..].join(" -> "));
        }
        if !done.insert(m) {
            return;
        }
        path.push(m);
        for d in &g[m] {
            visit(g, d, path, done);
        }
        path.pop();
    }
    let mut done = BTreeSet::new();
    for m in g.keys().filter(|m| *m != "lib") {
        visit(&g, m, &mut Vec::new(), &mut done);
    }
}

#[test]
fn the_modules_the_controller_spawns_do_not_import_it() {
    let g = graph();
    for task in ["boot", "runner", "monitor", "suspender"] {
        let deps = &g[task];
        assert!(
            !deps.contains("controller"),
            "{task} imports controller: {deps:?}"
        );
    }
    assert!(g["controller"].is_superset(&BTreeSet::from(
        ["boot", "runner", "monitor", "suspender"].map(String::from)
    )));
}
