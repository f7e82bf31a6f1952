//! The runbooks' command lines checked without running them, so blocks shown but not run (they need a
//! node, a cluster or GitHub) are held to the same standard as the run ones:
//! - every `kubectl` and `helm` command line is parsed by the real binary: the same arguments with
//!   `--help` added (before a `--`) make cobra parse every flag, fail on an unknown one, and print help
//!   instead of running;
//! - every file a command reads, and the directory of every file it writes, was created earlier on the
//!   pages (in the order an operator follows them), exists on any Linux host, is in the checkout, or is
//!   a file the operator supplies (a variable of runbooks/README.md's table).
//!
//! The shell is split as far as the runbooks need: `;`, `&&`, `||`, `|`, `&`, newlines, `$(...)` and
//! backticks (checked as commands of their own), `\` continuations, comments, here-documents (their
//! body is data), redirections, leading `NAME=value` assignments and the keywords of `if`/`for`/`while`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

/// One simple command of a block.
#[derive(Debug, Clone, PartialEq)]
pub struct Cmd {
    /// Line in the block, from 1.
    pub line: usize,
    pub argv: Vec<String>,
    /// Leading `NAME=value` words.
    pub assigns: Vec<(String, String)>,
    /// (`<` read or `>`/`>>` write, target).
    pub redirects: Vec<(bool, String)>,
}

/// The simple commands of a script, in order (a command substitution before the command holding it).
pub fn commands(script: &str) -> Result<Vec<Cmd>, String> {
    let joined = script.replace("\\\n", " \u{1}");
    let mut out = Vec::new();
    let mut lines = joined.split('\n').enumerate().peekable();
    // Line numbers count the joined continuations back in.
    let mut line_no = 0;
    while let Some((_, raw)) = lines.next() {
        line_no += 1;
        let here = heredoc_word(raw);
        let text = raw.replace('\u{1}', "");
        segments(&text, line_no, &mut out)?;
        line_no += raw.matches('\u{1}').count();
        if let Some(word) = here {
            loop {
                let Some((_, l)) = lines.next() else {
                    return Err(format!("line {line_no}: here-document {word} never ends"));
                };
                line_no += 1;
                if l.trim() == word {
                    break;
                }
            }
        }
    }
    Ok(out)
}

/// The delimiter of a here-document started on this line (`<<WORD`, `<<-WORD`, `<<'WORD'`).
fn heredoc_word(line: &str) -> Option<String> {
    let (mut single, mut double) = (false, false);
    let b = line.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\'' if !double => single = !single,
            b'"' if !single => double = !double,
            b'<' if !single
                && !double
                && b.get(i + 1) == Some(&b'<')
                && b.get(i + 2) != Some(&b'<') =>
            {
                let rest = line[i + 2..].trim_start_matches('-').trim_start();
                let word: String = rest
                    .trim_start_matches(['\'', '"'])
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                return (!word.is_empty()).then_some(word);
            }
            _ => {}
        }
        i += 1;
    }
    None
}

/// Splits one line into simple commands (appended to `out`).
fn segments(line: &str, line_no: usize, out: &mut Vec<Cmd>) -> Result<(), String> {
    let chars: Vec<char> = line.chars().collect();
    let mut buf = String::new();
    let (mut single, mut double) = (false, false);
    let mut i = 0;
    let flush = |buf: &mut String, out: &mut Vec<Cmd>| -> Result<(), String> {
        let seg = std::mem::take(buf);
        if let Some(c) = simple_command(&seg, line_no)? {
            out.push(c);
        }
        Ok(())
    };
    while i < chars.len() {
        let c = chars[i];
        match c {
            '\'' if !double => {
                single = !single;
                buf.push(c);
            }
            '"' if !single => {
                double = !double;
                buf.push(c);
            }
            '\\' if !single => {
                buf.push(c);
                if let Some(n) = chars.get(i + 1) {
                    buf.push(*n);
                    i += 1;
                }
            }
            '#' if !single && !double && buf.chars().last().is_none_or(char::is_whitespace) => {
                break;
            }
            '$' if !single && chars.get(i + 1) == Some(&'(') && chars.get(i + 2) != Some(&'(') => {
                let end = matching(&chars, i + 1, '(', ')')
                    .ok_or_else(|| format!("line {line_no}: unclosed $( in {line:?}"))?;
                let inner: String = chars[i + 2..end].iter().collect();
                segments(&inner, line_no, out)?;
                buf.push_str("SUBST");
                i = end;
            }
            '`' if !single => {
                let end = (i + 1..chars.len())
                    .find(|j| chars[*j] == '`')
                    .ok_or_else(|| format!("line {line_no}: unclosed ` in {line:?}"))?;
                let inner: String = chars[i + 1..end].iter().collect();
                segments(&inner, line_no, out)?;
                buf.push_str("SUBST");
                i = end;
            }
            '&' if !single && !double && matches!(buf.chars().last(), Some('>' | '<')) => {
                buf.push(c)
            }
            '&' if !single && !double && chars.get(i + 1) == Some(&'>') => buf.push(c),
            '|' | '&' | ';' | '(' | ')' if !single && !double => flush(&mut buf, out)?,
            _ => buf.push(c),
        }
        i += 1;
    }
    if single || double {
        return Err(format!("line {line_no}: unclosed quote in {line:?}"));
    }
    flush(&mut buf, out)
}

/// Index of the `close` matching the `open` at `start`, skipping quoted text.
fn matching(chars: &[char], start: usize, open: char, close: char) -> Option<usize> {
    let (mut depth, mut single, mut double) = (0, false, false);
    for (j, c) in chars.iter().enumerate().skip(start) {
        match *c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            c if c == open && !single && !double => depth += 1,
            c if c == close && !single && !double => {
                depth -= 1;
                if depth == 0 {
                    return Some(j);
                }
            }
            _ => {}
        }
    }
    None
}

const KEYWORDS: &[&str] = &[
    "if", "then", "else", "elif", "do", "while", "until", "!", "{", "}", "time",
];
const SKIPPED: &[&str] = &["for", "case", "done", "fi", "esac", "in"];

fn simple_command(seg: &str, line: usize) -> Result<Option<Cmd>, String> {
    // A here-document's operator is not a word of the command.
    let seg = match seg.find("<<") {
        Some(i) if !seg[i..].starts_with("<<<") => {
            let rest = &seg[i + 2..];
            let word_end = rest
                .trim_start_matches('-')
                .trim_start()
                .find(char::is_whitespace)
                .map(|e| e + (rest.len() - rest.trim_start_matches('-').trim_start().len()))
                .unwrap_or(rest.len());
            format!("{}{}", &seg[..i], &rest[word_end..])
        }
        _ => seg.to_owned(),
    };
    let words = shlex::split(&seg).ok_or_else(|| format!("line {line}: cannot split {seg:?}"))?;
    let mut words = words.into_iter().peekable();
    while words.peek().is_some_and(|w| KEYWORDS.contains(&w.as_str())) {
        words.next();
    }
    if words.peek().is_some_and(|w| SKIPPED.contains(&w.as_str())) {
        return Ok(None);
    }
    let mut assigns = Vec::new();
    while let Some((name, value)) = words.peek().and_then(|w| assignment(w)) {
        assigns.push((name, value));
        words.next();
    }
    let mut argv = Vec::new();
    let mut redirects = Vec::new();
    while let Some(w) = words.next() {
        let ops = w.trim_start_matches(|c: char| c.is_ascii_digit());
        let op = ["&>>", "&>", ">>", ">|", ">", "<"]
            .into_iter()
            .find(|op| ops.starts_with(op) && !ops.starts_with("<<<"));
        match op {
            Some(op) => {
                let rest = &ops[op.len()..];
                if rest.starts_with('&') {
                    continue; // 2>&1: a descriptor, not a file
                }
                let target = if rest.is_empty() {
                    words.next()
                } else {
                    Some(rest.to_owned())
                };
                if let Some(t) = target {
                    redirects.push((op == "<", t));
                }
            }
            None => argv.push(w),
        }
    }
    if argv.is_empty() && assigns.is_empty() {
        return Ok(None);
    }
    Ok(Some(Cmd {
        line,
        argv,
        assigns,
        redirects,
    }))
}

fn assignment(w: &str) -> Option<(String, String)> {
    let (name, value) = w.split_once('=')?;
    let ok = !name.is_empty()
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !name.starts_with(|c: char| c.is_ascii_digit());
    ok.then(|| (name.to_owned(), value.to_owned()))
}

/// Words that run the command after them (with their own flags skipped).
fn unwrap(argv: &[String]) -> &[String] {
    match argv.first().map(String::as_str) {
        Some("sudo" | "exec" | "command" | "nohup") => unwrap(&argv[1..]),
        Some("xargs" | "watch") => {
            let i = argv[1..]
                .iter()
                .position(|a| !a.starts_with('-'))
                .map_or(argv.len(), |p| p + 1);
            unwrap(&argv[i..])
        }
        Some("timeout") => unwrap(argv.get(2..).unwrap_or_default()),
        _ => argv,
    }
}

/// Checks kubectl and helm command lines with the real binaries in `bin` (results cached by argv).
pub struct FlagChecker {
    bin: PathBuf,
    path: String,
    home: tempfile::TempDir,
    seen: HashMap<Vec<String>, Result<(), String>>,
}

impl FlagChecker {
    /// `extra_path`: directories searched for kubectl plugins (e.g. `kubectl-imp`).
    pub fn new(bin: &Path, extra_path: &[PathBuf]) -> Self {
        let mut path: Vec<String> = vec![bin.display().to_string()];
        path.extend(extra_path.iter().map(|p| p.display().to_string()));
        path.push(std::env::var("PATH").unwrap_or_default());
        FlagChecker {
            bin: bin.to_owned(),
            path: path.join(":"),
            home: tempfile::tempdir().unwrap(),
            seen: HashMap::new(),
        }
    }

    /// Err(the binary's complaint) when `cmd` is kubectl or helm and does not parse.
    pub fn check(&mut self, cmd: &Cmd) -> Result<(), String> {
        let argv = unwrap(&cmd.argv);
        let Some(prog) = argv
            .first()
            .filter(|p| matches!(p.as_str(), "kubectl" | "helm"))
        else {
            return Ok(());
        };
        if let Some(r) = self.seen.get(argv) {
            return r.clone();
        }
        let (before, after) = match argv.iter().position(|a| a == "--") {
            Some(i) => (&argv[1..i], &argv[i..]),
            None => (&argv[1..], &[][..]),
        };
        let h = self.home.path();
        let out = Command::new(self.bin.join(prog))
            .args(before)
            .arg("--help")
            .args(after)
            .env("PATH", &self.path)
            .env("KUBECONFIG", h.join("no-kubeconfig"))
            .env("HELM_CACHE_HOME", h.join("cache"))
            .env("HELM_CONFIG_HOME", h.join("config"))
            .env("HELM_DATA_HOME", h.join("data"))
            .output()
            .unwrap_or_else(|e| panic!("run {}/{prog}: {e}", self.bin.display()));
        let r = if out.status.success() {
            Ok(())
        } else {
            let err = String::from_utf8_lossy(&out.stderr);
            Err(err.lines().next().unwrap_or("exited non-zero").to_owned())
        };
        self.seen.insert(argv.to_vec(), r.clone());
        r
    }
}

/// Paths every Linux host has, and the trees the host's kernel provides.
const HOST_DIRS: &[&str] = &[
    "/",
    "/bin",
    "/usr",
    "/usr/bin",
    "/usr/local",
    "/usr/local/bin",
    "/usr/sbin",
    "/sbin",
    "/etc",
    "/tmp",
    "/run",
    "/var",
    "/var/lib",
    "/var/log",
    "/usr/src",
    "/boot",
    "~",
    "~/.config",
];
const HOST_TREES: &[&str] = &["/dev", "/proc", "/sys"];
/// What imp-runtime creates on a node once the chart is installed (helm/imp/values.yaml's paths).
const IMP_TREES: &[&str] = &["/var/lib/imp", "/run/imp"];

/// Flags whose value is a file read (`kubectl -f`, `helm -f`, `--from-file=[key=]path`, ...).
const READ_FLAGS: &[&str] = &[
    "-f",
    "--filename",
    "--values",
    "--from-file",
    "--kubeconfig",
    "--token-file",
    "--source",
    "--base-config",
    "--pool-manifest",
    "--workflow-file",
    "--ca-file",
    "--cert-file",
    "--key-file",
];
/// Flags whose value is a directory a tool creates (images/*/build.sh).
const OUT_DIR_FLAGS: &[&str] = &["--out"];

/// The files the pages create and the paths they use, followed page after page.
pub struct PathTracker {
    /// Files and directories known to exist.
    exists: BTreeSet<PathBuf>,
    /// Directories whose whole content is unknown but trusted (a tool's output, an archive's).
    trees: BTreeSet<PathBuf>,
    /// Variables with a literal value assigned on the pages.
    vars: BTreeMap<String, String>,
    /// Variables the operator supplies (runbooks/README.md): a path they hold is theirs.
    supplied: BTreeSet<String>,
    checkout: PathBuf,
}

impl PathTracker {
    pub fn new(checkout: &Path, supplied: &[&str]) -> Self {
        PathTracker {
            exists: HOST_DIRS.iter().map(PathBuf::from).collect(),
            trees: HOST_TREES.iter().map(PathBuf::from).collect(),
            vars: BTreeMap::new(),
            supplied: supplied.iter().map(|s| s.to_string()).collect(),
            checkout: checkout.to_owned(),
        }
    }

    /// `$X`, `${X}` and `${X:-...}` replaced from the pages' literal assignments; None when a variable
    /// is not known (the word is not checked) or is one the operator supplies.
    fn expand(&self, word: &str) -> Option<String> {
        let mut out = String::new();
        let mut rest = word;
        while let Some(i) = rest.find('$') {
            out.push_str(&rest[..i]);
            let after = &rest[i + 1..];
            let (name, len) = if let Some(b) = after.strip_prefix('{') {
                let end = b.find('}')?;
                let name: String = b[..end]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                (name, end + 2)
            } else {
                let name: String = after
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                let n = name.len();
                (name, n)
            };
            if self.supplied.contains(&name) {
                return None;
            }
            out.push_str(self.vars.get(&name)?);
            rest = &after[len..];
        }
        out.push_str(rest);
        (!out.contains("SUBST")).then_some(out)
    }

    fn norm(&self, p: &str) -> PathBuf {
        let mut out = PathBuf::new();
        for c in Path::new(p).components() {
            match c {
                Component::CurDir => {}
                Component::ParentDir => {
                    out.pop();
                }
                c => out.push(c),
            }
        }
        out
    }

    fn known(&self, p: &Path) -> bool {
        self.exists.contains(p)
            || self.trees.iter().any(|t| p.starts_with(t))
            || (p.is_relative() && !p.starts_with("~") && self.checkout.join(p).exists())
    }

    fn create(&mut self, p: &Path, parents: bool) -> Result<(), String> {
        let parent = p.parent().filter(|d| !d.as_os_str().is_empty());
        if let Some(d) = parent {
            if parents {
                for a in d.ancestors() {
                    self.exists.insert(a.to_owned());
                }
            } else if !self.known(d) {
                return Err(format!(
                    "{} is written before its directory {} exists",
                    p.display(),
                    d.display()
                ));
            }
        }
        self.exists.insert(p.to_owned());
        Ok(())
    }

    fn need(&self, p: &Path) -> Result<(), String> {
        if self.known(p) {
            Ok(())
        } else {
            Err(format!(
                "{} is used before any command on the pages creates it",
                p.display()
            ))
        }
    }

    /// A word that names a file here: a path-looking word whose variables are known.
    fn path_word(&self, w: &str) -> Option<PathBuf> {
        let w = self.expand(w)?;
        let looks = !w.is_empty()
            && !w.starts_with('-')
            && !w.contains("://")
            && !w.contains(char::is_whitespace)
            && (w.starts_with('/')
                || w.starts_with("~/")
                || w.starts_with("./")
                || w.contains('/'));
        looks.then(|| self.norm(&w))
    }

    fn paths(&self, ws: &[&String]) -> Vec<PathBuf> {
        ws.iter().filter_map(|w| self.path_word(w)).collect()
    }

    /// Records the effects of one command and checks the paths it uses.
    pub fn apply(&mut self, cmd: &Cmd) -> Result<(), String> {
        for (k, v) in &cmd.assigns {
            match self.expand(v) {
                Some(v) if !v.contains('$') => self.vars.insert(k.clone(), v),
                _ => self.vars.remove(k),
            };
        }
        for (read, target) in &cmd.redirects {
            let Some(p) = self.expand(target).map(|t| self.norm(&t)) else {
                continue;
            };
            if p.starts_with("/dev") {
                continue;
            }
            if *read {
                self.need(&p)?;
            } else {
                self.create(&p, false)?;
            }
        }
        let argv = unwrap(&cmd.argv);
        let Some(prog) = argv.first() else {
            return Ok(());
        };
        let args = &argv[1..];
        let operands: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
        match prog.as_str() {
            "mkdir" => {
                let parents = args.iter().any(|a| a == "-p" || a == "--parents");
                for p in self.paths(&operands) {
                    self.create(&p, parents)?;
                }
            }
            "install" => {
                let dirs = args.iter().any(|a| a == "-d");
                let parents = args.iter().any(|a| a == "-D");
                let ops: Vec<&String> = operand_words(args, &["-m", "--mode", "-o", "-g"]);
                if dirs {
                    for p in self.paths(&ops) {
                        self.create(&p, true)?;
                    }
                } else if let Some((dst, srcs)) = ops.split_last() {
                    for p in self.paths(srcs) {
                        self.need(&p)?;
                    }
                    if let Some(d) = self.path_word(dst) {
                        self.create(&d, parents)?;
                    }
                }
            }
            "cp" | "mv" => {
                let ops = operand_words(args, &[]);
                if let Some((dst, srcs)) = ops.split_last() {
                    for p in self.paths(srcs) {
                        self.need(&p)?;
                    }
                    if let Some(d) = self.path_word(dst) {
                        self.create(&d, false)?;
                    }
                }
            }
            "tee" | "touch" => {
                for p in self.paths(&operands) {
                    self.create(&p, false)?;
                }
            }
            "rm" | "rmdir" | "umount" => {}
            // A package puts its files under /usr; which ones the test cannot know.
            "apt-get" | "apt" if args.iter().any(|a| a == "install") => {
                self.trees.insert(PathBuf::from("/usr"));
            }
            "curl" => {
                let remote = args
                    .iter()
                    .any(|a| a == "--remote-name" || (is_short_cluster(a) && a.contains('O')));
                if remote {
                    for u in args.iter().filter(|a| a.contains("://")) {
                        if let Some(name) = self
                            .expand(u)
                            .and_then(|u| u.rsplit('/').next().map(String::from))
                        {
                            self.create(Path::new(&name), false)?;
                        }
                    }
                }
                if let Some(o) = flag_value(args, &["-o", "--output"])
                    .and_then(|o| self.path_word(&o).or(Some(PathBuf::from(o))))
                {
                    self.create(&o, false)?;
                }
            }
            "tar" => {
                let extract = args.iter().any(|a| {
                    a == "-x" || a == "--extract" || (is_short_cluster(a) && a.contains('x'))
                });
                let archive = tar_archive(args);
                if let Some(a) = archive.as_ref().and_then(|a| self.expand(a)) {
                    self.need(&self.norm(&a))?;
                }
                let dir = flag_value(args, &["-C", "--directory"]).and_then(|d| self.path_word(&d));
                if let Some(d) = &dir {
                    self.need(d)?;
                }
                if extract {
                    let members: Vec<&String> =
                        operand_words(args, &["-f", "--file", "-C", "--directory"])
                            .into_iter()
                            .filter(|m| Some(*m) != archive.as_ref())
                            .collect();
                    let base = dir.unwrap_or_default();
                    if members.is_empty() {
                        // Without named members the archive's content is unknown: trust the directory.
                        if !base.as_os_str().is_empty() {
                            self.trees.insert(base.clone());
                        }
                    }
                    for m in members {
                        if let Some(m) = self.expand(m) {
                            let p = base.join(self.norm(&m));
                            self.create(&p, true)?;
                        }
                    }
                }
            }
            "kubectl" | "helm" => {
                for v in flag_values(args, READ_FLAGS) {
                    // --from-file=key=path: the path after the key.
                    let v = v.rsplit_once('=').map_or(v.as_str(), |(_, p)| p).to_owned();
                    if v == "-" {
                        continue;
                    }
                    if let Some(p) = self.expand(&v).map(|v| self.norm(&v)) {
                        self.need(&p)?;
                    }
                }
                // Installing the chart gives every node the runtime's state directories.
                if prog == "helm" && args.iter().any(|a| a == "install" || a == "upgrade") {
                    self.trees.extend(IMP_TREES.iter().map(PathBuf::from));
                }
            }
            "test" | "[" => {
                // A check, not a use: `test -c /dev/kvm` is how a page finds out.
            }
            _ => {
                if let Some(p) = self.path_word(prog) {
                    self.need(&p)?;
                }
                for v in flag_values(args, READ_FLAGS) {
                    if let Some(p) = self.path_word(&v) {
                        self.need(&p)?;
                    }
                }
                for v in flag_values(args, OUT_DIR_FLAGS) {
                    if let Some(p) = self.path_word(&v) {
                        self.create(&p, true)?;
                        self.trees.insert(p);
                    }
                }
                let checks_files = matches!(
                    prog.as_str(),
                    "cat"
                        | "sha256sum"
                        | "ls"
                        | "chmod"
                        | "chown"
                        | "source"
                        | "."
                        | "sqlite3"
                        | "stat"
                );
                let ops = match prog.as_str() {
                    // grep's first operand is the pattern.
                    "grep" if !args.iter().any(|a| a == "-e" || a == "-f") => {
                        operands.get(1..).unwrap_or_default().to_vec()
                    }
                    "grep" => operands.clone(),
                    _ if checks_files => operand_words(args, &[]),
                    _ => vec![],
                };
                for p in self.paths(&ops) {
                    self.need(&p)?;
                }
            }
        }
        Ok(())
    }
}

fn is_short_cluster(a: &str) -> bool {
    a.starts_with('-') && !a.starts_with("--") && a.len() > 1
}

/// Operands, skipping flags and the values of `with_value` flags.
fn operand_words<'a>(args: &'a [String], with_value: &[&str]) -> Vec<&'a String> {
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if with_value.contains(&a.as_str()) {
            it.next();
        } else if !a.starts_with('-') {
            out.push(a);
        }
    }
    out
}

fn flag_value(args: &[String], names: &[&str]) -> Option<String> {
    flag_values(args, names).into_iter().next()
}

/// Values of `--flag value`, `--flag=value` and `-f value` occurrences.
fn flag_values(args: &[String], names: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, a) in args.iter().enumerate() {
        if names.contains(&a.as_str()) {
            if let Some(v) = args.get(i + 1) {
                out.push(v.clone());
            }
        } else if let Some((k, v)) = a.split_once('=')
            && names.contains(&k)
        {
            out.push(v.to_owned());
        }
    }
    out
}

/// The archive of a tar command line (`-f X`, `--file X`, or the operand after a `-xzf` cluster).
fn tar_archive(args: &[String]) -> Option<String> {
    for (i, a) in args.iter().enumerate() {
        if a == "-f" || a == "--file" || (is_short_cluster(a) && a.ends_with('f')) {
            return args.get(i + 1).cloned();
        }
        if let Some(v) = a.strip_prefix("--file=") {
            return Some(v.to_owned());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argvs(s: &str) -> Vec<Vec<String>> {
        commands(s).unwrap().into_iter().map(|c| c.argv).collect()
    }

    #[test]
    fn splits_pipes_substitutions_heredocs_and_continuations() {
        let s = "NODE=${NODE:?}\nkubectl get pods --field-selector \"spec.nodeName=$NODE\" \\\n  -o wide | grep -i x\n\
                 cat > v.yaml <<VALUES\nkubectl bogus --nope\nVALUES\n\
                 test \"$(kubectl get ds x -o jsonpath='{.a}')\" = OnDelete && echo ok # kubectl --x\n\
                 for crd in a b; do kubectl get crd \"$crd.imp.dev\" -o name; done\n";
        let got = argvs(s);
        let want: Vec<Vec<&str>> = vec![
            vec![],
            vec![
                "kubectl",
                "get",
                "pods",
                "--field-selector",
                "spec.nodeName=$NODE",
                "-o",
                "wide",
            ],
            vec!["grep", "-i", "x"],
            vec!["cat"],
            vec!["kubectl", "get", "ds", "x", "-o", "jsonpath={.a}"],
            vec!["test", "SUBST", "=", "OnDelete"],
            vec!["echo", "ok"],
            vec!["kubectl", "get", "crd", "$crd.imp.dev", "-o", "name"],
        ];
        assert_eq!(got, want);
        let cmds = commands(s).unwrap();
        assert_eq!(cmds[0].assigns, [("NODE".into(), "${NODE:?}".into())]);
        assert_eq!(cmds[3].redirects, [(false, "v.yaml".into())]);
        assert_eq!(
            cmds[4].line, 7,
            "lines count continuations and here-document bodies"
        );
        assert!(commands("echo 'x\n").is_err());
    }

    #[test]
    fn paths_must_be_created_first() {
        let mut t = PathTracker::new(Path::new("/nonexistent-checkout"), &["APP_KEY"]);
        let mut run = |s: &str| -> Result<(), String> {
            for c in commands(s).unwrap() {
                t.apply(&c)?;
            }
            Ok(())
        };
        let e = run("sha256sum /usr/local/bin/fc | tee -a /var/lib/imp/PROVENANCE\n").unwrap_err();
        assert!(e.contains("/usr/local/bin/fc is used before"), "{e}");
        run("install -m 0755 rel-v1/fc /usr/local/bin/fc\n").unwrap_err();
        run("FC=v1\ncurl -fsSLO \"https://h/d/$FC/fc-$FC.tgz\"\ntar -xzf \"fc-$FC.tgz\" \"rel-$FC/fc\"\n")
            .unwrap();
        run("install -m 0755 rel-v1/fc /usr/local/bin/fc\n").unwrap();
        let e = run("sha256sum /usr/local/bin/fc | tee -a /var/lib/imp/PROVENANCE\n").unwrap_err();
        assert!(e.contains("directory /var/lib/imp exists"), "{e}");
        run("install -d /var/lib/imp\nsha256sum /usr/local/bin/fc | tee -a /var/lib/imp/P\n")
            .unwrap();
        run("kubectl apply -f pool.yaml\n").unwrap_err();
        run("cat > pool.yaml <<X\ny\nX\nkubectl apply -f pool.yaml -f -\n").unwrap();
        run("kubectl create secret generic s --from-file=private-key=\"$APP_KEY\"\n").unwrap();
        run("grep -c vmx /proc/cpuinfo\ntest -c /dev/kvm\n").unwrap();
        run("cat /run/imp/x\n").unwrap_err();
        run("helm upgrade --install imp c\ncat /run/imp/x\n").unwrap();
    }
}
