//! The shell blocks of a runbook page (runbooks/*.md): what the runbook test lints and runs, and
//! what the real-node test runs of runbooks/uninstall.md on its node.

/// Info-string markers of blocks that need more than the test control plane.
pub const NEEDS: &[&str] = &["needs-github", "needs-node", "needs-cluster"];

#[derive(Debug)]
pub struct Block {
    pub page: String,
    /// The line of the opening fence (1-based).
    pub line: usize,
    /// `None`: runnable; `Some(marker)`: shown, not run.
    pub needs: Option<String>,
    pub script: String,
}

/// The ` ```sh ` blocks of one page. A `sh` block with an info string other than a NEEDS marker is an
/// error naming its line.
pub fn sh_blocks(page: &str, text: &str) -> Result<Vec<Block>, String> {
    let mut blocks = Vec::new();
    let mut lines = text.lines().enumerate();
    while let Some((i, line)) = lines.next() {
        let Some(info) = line.trim_start().strip_prefix("```") else {
            continue;
        };
        let mut words = info.split_whitespace();
        let lang = words.next();
        let rest: Vec<&str> = words.collect();
        let mut body = String::new();
        let mut closed = false;
        for (_, l) in lines.by_ref() {
            if l.trim_start().starts_with("```") {
                closed = true;
                break;
            }
            body.push_str(l);
            body.push('\n');
        }
        if !closed {
            return Err(format!("{page}:{}: unclosed code block", i + 1));
        }
        if lang != Some("sh") {
            continue;
        }
        let needs = match rest.as_slice() {
            [] => None,
            [marker] if NEEDS.contains(marker) => Some((*marker).to_owned()),
            other => {
                return Err(format!(
                    "{page}:{}: sh block marked {other:?}; use one of {NEEDS:?} or none (runbooks/README.md)",
                    i + 1
                ));
            }
        };
        blocks.push(Block {
            page: page.to_owned(),
            line: i + 1,
            needs,
            script: body,
        });
    }
    Ok(blocks)
}

/// The lines (1-based, inclusive start, exclusive end) of the section whose `## ` heading starts
/// with `heading`, up to the next `## ` heading.
pub fn section_lines(text: &str, heading: &str) -> Option<std::ops::Range<usize>> {
    let h2 = |l: &str| l.starts_with("## ");
    let start = text
        .lines()
        .position(|l| h2(l) && l[3..].starts_with(heading))?;
    let end = text
        .lines()
        .enumerate()
        .skip(start + 1)
        .find(|(_, l)| h2(l))
        .map_or(text.lines().count(), |(i, _)| i);
    Some(start + 1..end + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_section_runs_from_its_heading_to_the_next() {
        let text = "# T\n## 1. A\n```sh\na\n```\n## 2. B\n```sh\nb\n```\n";
        let one = section_lines(text, "1. ").unwrap();
        let two = section_lines(text, "2. ").unwrap();
        assert_eq!((one.clone(), two.clone()), (2..6, 6..10));
        let blocks = sh_blocks("p.md", text).unwrap();
        let in_ = |r: &std::ops::Range<usize>| {
            blocks
                .iter()
                .filter(|b| r.contains(&b.line))
                .map(|b| b.script.as_str())
                .collect::<Vec<_>>()
        };
        assert_eq!((in_(&one), in_(&two)), (vec!["a\n"], vec!["b\n"]));
        assert_eq!(section_lines(text, "3. "), None);
    }
}
