//! Checks on ext4 images the tests build, with e2fsprogs.

use std::path::Path;
use std::process::Command;

/// Asserts that `e2fsck -f -n` (forced, read-only) finds `image` clean.
pub fn assert_fsck_clean(image: &Path) {
    let fsck = Command::new("e2fsck")
        .args(["-f", "-n"])
        .arg(image)
        .output()
        .expect("run e2fsck (Debian package e2fsprogs)");
    assert!(
        fsck.status.success(),
        "e2fsck -f -n {}: {}{}",
        image.display(),
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
}
