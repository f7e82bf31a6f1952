//! Text a guest chose (a spawn failure, a probe's error), made fit for status, conditions and
//! Events: once the job runs the guest is hostile, and whatever it says is shown to users by
//! kubectl and dashboards. Bounded (a guest could send up to a frame, 1 MiB) and stripped of
//! control characters (terminal escapes, fake extra lines in `kubectl describe`).

/// Characters of guest text kept; the rest is replaced by a note of how much was cut.
pub const MAX_CHARS: usize = 256;

/// `text` with every control character (newlines included) replaced by `?`, cut to
/// [`MAX_CHARS`] characters with a note saying how many bytes the guest sent.
pub fn guest_text(text: &str) -> String {
    let mut out: String = text
        .chars()
        .take(MAX_CHARS)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    if text.chars().nth(MAX_CHARS).is_some() {
        out.push_str(&format!("... (cut; the guest sent {} bytes)", text.len()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_plain_text_is_kept() {
        assert_eq!(guest_text("exec: no such file"), "exec: no such file");
        assert_eq!(guest_text(""), "");
    }

    #[test]
    fn control_characters_become_question_marks() {
        assert_eq!(
            guest_text("a\nReason: Fake\x1b[2Jb\r"),
            "a?Reason: Fake?[2Jb?"
        );
    }

    #[test]
    fn long_text_is_cut_at_a_character_boundary_and_says_so() {
        let long = "é".repeat(1 << 19);
        let out = guest_text(&long);
        assert!(out.starts_with(&"é".repeat(MAX_CHARS)), "{}", &out[..20]);
        assert!(
            out.ends_with("(cut; the guest sent 1048576 bytes)"),
            "{out}"
        );
        assert!(out.chars().count() < MAX_CHARS + 50);
        // Exactly at the bound: nothing cut.
        assert_eq!(guest_text(&"x".repeat(MAX_CHARS)), "x".repeat(MAX_CHARS));
    }
}
