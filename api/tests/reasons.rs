//! The reasons Imp writes have one home, `imp_api::names` (api/src/names.rs): docs/reasons.md is
//! generated from it, and no other source file of the workspace spells a reason as a string literal.

use std::{
    fs,
    path::{Path, PathBuf},
};

use imp_api::names::reason;

/// Literals equal to a reason value that are not reasons, each with why; keep this short.
/// The word "Booting" is also a runtime VM state and a pool column; the reason keeps the
/// documented name rather than renaming either.
const NOT_REASONS: &[(&str, &str, &str)] = &[
    (
        "node/runtime-api/src/api.rs",
        reason::BOOTING,
        "VmState::Booting's name in imp-runtime's inventory and API: a VM state",
    ),
    (
        "api/src/pool.rs",
        reason::BOOTING,
        "the ImpVMRunnerPool printer column header `Booting`",
    ),
];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("api/ has a parent")
        .to_path_buf()
}

#[test]
fn docs_reasons_md_is_generated_from_the_constants() {
    let path = repo_root().join("docs/reasons.md");
    let committed =
        fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    assert!(
        committed == reason::markdown(),
        "docs/reasons.md differs from imp_api::names::reason; regenerate it with `make reasons` \
         (cargo run -p imp-api --bin reasondoc) and commit the result"
    );
}

/// The workspace's member crates, read from the root Cargo.toml so a new crate is walked too.
fn members(root: &Path) -> Vec<String> {
    let manifest = fs::read_to_string(root.join("Cargo.toml")).expect("read Cargo.toml");
    let line = manifest
        .lines()
        .find(|l| l.trim_start().starts_with("members"))
        .expect("Cargo.toml: no `members = [...]` line in [workspace]");
    let list = line
        .split_once('[')
        .and_then(|(_, rest)| rest.split_once(']'))
        .expect("Cargo.toml: `members` is not a one-line list")
        .0;
    list.split(',')
        .map(|m| m.trim().trim_matches('"').to_owned())
        .filter(|m| !m.is_empty())
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.expect("read_dir entry").path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n == "target") {
                continue;
            }
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The string literals of Rust source `src` (plain, raw and byte strings), each with its line.
/// Comments, char literals and lifetimes are skipped; escapes are kept as written, which is exact
/// for reasons (CamelCase, no escapes).
fn string_literals(src: &str) -> Vec<(usize, String)> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == b'\n' {
            line += 1;
            i += 1;
        } else if c == b'/' && next == Some(b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && next == Some(b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += usize::from(b[i] == b'\n');
                    i += 1;
                }
            }
        } else if (c == b'r' || (c == b'b' && next == Some(b'r')))
            && (i == 0 || !ident(b[i - 1]))
            && {
                let j = i + if c == b'b' { 2 } else { 1 };
                let hashes = b[j..].iter().take_while(|&&h| h == b'#').count();
                b.get(j + hashes) == Some(&b'"')
            }
        {
            let j = i + if c == b'b' { 2 } else { 1 };
            let hashes = b[j..].iter().take_while(|&&h| h == b'#').count();
            let start = j + hashes + 1;
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            let len = b[start..]
                .windows(close.len())
                .position(|w| w == close.as_slice())
                .expect("unterminated raw string");
            let text = &src[start..start + len];
            out.push((line, text.to_owned()));
            line += text.matches('\n').count();
            i = start + len + close.len();
        } else if c == b'"' {
            let start = i + 1;
            let mut j = start;
            while b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            let text = &src[start..j];
            out.push((line, text.to_owned()));
            line += text.matches('\n').count();
            i = j + 1;
        } else if c == b'\'' {
            // A char literal ('x', '\n', '\u{..}', '"') or a lifetime ('a).
            if next == Some(b'\\') {
                let mut j = i + 3;
                while b[j] != b'\'' {
                    j += 1;
                }
                i = j + 1;
            } else if let Some(ch) = src[i + 1..].chars().next()
                && src[i + 1 + ch.len_utf8()..].starts_with('\'')
            {
                i += 2 + ch.len_utf8();
            } else {
                i += 1;
            }
        } else {
            i += 1;
        }
    }
    out
}

/// Literals in `src` equal to a reason value: (line, value).
fn reason_literals(src: &str) -> Vec<(usize, &'static str)> {
    string_literals(src)
        .into_iter()
        .filter_map(|(line, text)| {
            reason::ALL
                .iter()
                .find(|r| r.value == text)
                .map(|r| (line, r.value))
        })
        .collect()
}

#[test]
fn no_reason_literal_outside_imp_api_names() {
    let root = repo_root();
    let mut files = Vec::new();
    for member in members(&root) {
        let dir = root.join(&member);
        assert!(dir.is_dir(), "workspace member {member} is not a directory");
        rust_files(&dir, &mut files);
    }
    files.sort();
    assert!(files.len() > 50, "found only {} .rs files", files.len());
    let home = root.join("api/src/names.rs");
    assert!(files.contains(&home), "api/src/names.rs not walked");
    let mut found = Vec::new();
    for file in files.iter().filter(|f| **f != home) {
        let rel = file
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let src = fs::read_to_string(file).unwrap_or_else(|e| panic!("read {rel}: {e}"));
        for (line, value) in reason_literals(&src) {
            if !NOT_REASONS.iter().any(|(f, v, _)| *f == rel && *v == value) {
                found.push(format!("{rel}:{line}: \"{value}\""));
            }
        }
    }
    assert!(
        found.is_empty(),
        "reason string literals outside api/src/names.rs; use the imp_api::names::reason constants \
         (or names::condition for condition types):\n{}",
        found.join("\n")
    );
}

#[test]
fn every_allowed_exception_still_exists() {
    let root = repo_root();
    for (file, value, why) in NOT_REASONS {
        let src =
            fs::read_to_string(root.join(file)).unwrap_or_else(|e| panic!("read {file}: {e}"));
        assert!(
            reason_literals(&src).iter().any(|(_, v)| v == value),
            "{file} no longer spells \"{value}\" ({why}); drop it from NOT_REASONS"
        );
    }
}

#[test]
fn the_scanner_finds_literals_and_skips_comments_chars_and_lifetimes() {
    let src = concat!(
        "// \"NodeLost\" in a line comment\n",
        "/* \"NodeLost\" /* nested */ \"NodeLost\" */\n",
        "fn f<'a>(x: &'a str) -> char { let q = '\"'; let e = '\\''; let u = 'é'; 'x' }\n",
        "let a = \"NodeLost\";\n",
        "let b = r#\"Expired\"#; let c = br\"VmLost\"; let d = b\"VmStopped\";\n",
        "let e = \"multi\nline\"; let f = \"esc\\\"aped\"; let g = \"GuestReady\";\n",
        "let var = \"NodeLostX\"; let ident_r = str\"NotAReason\";\n",
    );
    let lits = string_literals(src);
    let texts: Vec<&str> = lits.iter().map(|(_, t)| t.as_str()).collect();
    assert_eq!(
        texts,
        [
            reason::NODE_LOST,
            reason::EXPIRED,
            reason::VM_LOST,
            reason::VM_STOPPED,
            "multi\nline",
            "esc\\\"aped",
            reason::GUEST_READY,
            "NodeLostX",
            "NotAReason"
        ]
    );
    assert_eq!(
        reason_literals(src),
        [
            (4, reason::NODE_LOST),
            (5, reason::EXPIRED),
            (5, reason::VM_LOST),
            (5, reason::VM_STOPPED),
            (7, reason::GUEST_READY)
        ],
        "line 7 follows the two-line literal"
    );
}
