//! Kernel modules from the initramfs, for distribution kernels (images/initrd/build.sh).
//!
//! When imp-guest is /init of an initrd built by images/initrd/build.sh, the initramfs holds the
//! modules the guest needs (virtio, vsock, overlay, ...) and a load-order list, [`LOAD_ORDER`]:
//! one module path per line, dependencies first, `#` comments and blank lines ignored. An
//! optional rest of the line after the path is passed as module parameters. Parameters on the
//! kernel command line addressed to a module (`virtio_mmio.device=...`) are added too, as
//! modprobe would do: the kernel applies those only to built-in code.
//!
//! Each module is loaded with finit_module(2). EEXIST (already loaded or built in) is fine;
//! any other error is fatal and names the module and the errno. No list file: nothing happens,
//! so PID 1 behaves as before with kernels that have everything built in.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::pid1::cmdline;

/// Where images/initrd/build.sh puts the list (relative to the initramfs root).
pub const LOAD_ORDER: &str = "lib/modules/imp/load-order";

#[derive(Debug, thiserror::Error)]
pub enum ModuleError {
    #[error("read {path}: {source}")]
    ReadList {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} line {line}: {reason}")]
    BadList {
        path: PathBuf,
        line: usize,
        reason: &'static str,
    },
    #[error("open module {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("load module {name} ({path}): {source}")]
    Load {
        name: String,
        path: PathBuf,
        source: nix::Error,
    },
}

/// One line of the load-order list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub path: PathBuf,
    /// Parameters from the list line ("" when none).
    pub params: String,
}

impl Entry {
    /// The module name the kernel uses: file name without `.ko`, dashes as underscores.
    pub fn name(&self) -> String {
        module_name(&self.path)
    }
}

pub fn module_name(path: &Path) -> String {
    let file = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem = file.split(".ko").next().unwrap_or(&file);
    stem.replace('-', "_")
}

/// Parse the list text. Errors carry the 1-based line number and a reason.
pub fn parse_list(text: &str) -> Result<Vec<Entry>, (usize, &'static str)> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (path, params) = match line.split_once(char::is_whitespace) {
            Some((p, rest)) => (p, rest.trim()),
            None => (line, ""),
        };
        if !path.starts_with('/') || path.contains("..") {
            return Err((i + 1, "module path must be absolute, without '..'"));
        }
        if !path.contains(".ko") {
            return Err((i + 1, "not a module file (*.ko)"));
        }
        out.push(Entry {
            path: PathBuf::from(path),
            params: params.to_owned(),
        });
    }
    Ok(out)
}

/// The parameter string for `module`: the list line's parameters, then every
/// `<module>.<param>[=value]` word of the kernel command line (module names compare with
/// dashes and underscores alike, as the kernel does).
pub fn params_for(module: &str, list_params: &str, cmdline_words: &[String]) -> String {
    let mut parts: Vec<String> = Vec::new();
    if !list_params.is_empty() {
        parts.push(list_params.to_owned());
    }
    for word in cmdline_words {
        let key = word.split('=').next().unwrap_or_default();
        let Some((m, param)) = key.split_once('.') else {
            continue;
        };
        if param.is_empty() || m.replace('-', "_") != module {
            continue;
        }
        let rest = &word[m.len() + 1..];
        // Values with spaces were quoted on the command line; keep them quoted for the kernel.
        if rest.contains(char::is_whitespace) {
            match rest.split_once('=') {
                Some((p, v)) => parts.push(format!("{p}=\"{v}\"")),
                None => parts.push(rest.to_owned()),
            }
        } else {
            parts.push(rest.to_owned());
        }
    }
    parts.join(" ")
}

/// Load one module file with finit_module(2). Ok(false) when it was already there (EEXIST).
pub fn load(path: &Path, params: &str) -> Result<bool, ModuleError> {
    let file = std::fs::File::open(path).map_err(|source| ModuleError::Open {
        path: path.to_owned(),
        source,
    })?;
    let params = std::ffi::CString::new(params).unwrap_or_default();
    // SAFETY: finit_module reads the open fd and a NUL-terminated string that outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_finit_module,
            file.as_raw_fd(),
            params.as_ptr(),
            0 as libc::c_int,
        )
    };
    if rc == 0 {
        return Ok(true);
    }
    match nix::Error::last() {
        nix::Error::EEXIST => Ok(false),
        source => Err(ModuleError::Load {
            name: module_name(path),
            path: path.to_owned(),
            source,
        }),
    }
}

/// What [`load_listed`] did, by module name.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Loaded {
    pub loaded: Vec<String>,
    /// Already loaded or built in (EEXIST).
    pub present: Vec<String>,
}

/// Load every module of `root/LOAD_ORDER` in order. `None` when there is no list (nothing to do).
pub fn load_listed(root: &Path, cmdline_text: &str) -> Result<Option<Loaded>, ModuleError> {
    let list = root.join(LOAD_ORDER);
    let text = match std::fs::read_to_string(&list) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(ModuleError::ReadList { path: list, source }),
    };
    let entries = parse_list(&text).map_err(|(line, reason)| ModuleError::BadList {
        path: list.clone(),
        line,
        reason,
    })?;
    let words = cmdline::split(cmdline_text).unwrap_or_default();
    let mut done = Loaded::default();
    for e in entries {
        let name = e.name();
        let params = params_for(&name, &e.params, &words);
        let rel = e.path.strip_prefix("/").unwrap_or(&e.path);
        if load(&root.join(rel), &params)? {
            done.loaded.push(name);
        } else {
            done.present.push(name);
        }
    }
    Ok(Some(done))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_lines_comments_and_params() {
        let text = "# generated by images/initrd/build.sh\n\n\
                    /lib/modules/imp/virtio.ko\n  /lib/modules/imp/virtio_blk.ko  \n\
                    /lib/modules/imp/vsock.ko\tfoo=1 bar=x\n";
        let got = parse_list(text).unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].path, PathBuf::from("/lib/modules/imp/virtio.ko"));
        assert_eq!(got[1].params, "");
        assert_eq!(got[2].params, "foo=1 bar=x");
        assert_eq!(got[2].name(), "vsock");
        assert_eq!(parse_list("").unwrap(), []);
    }

    #[test]
    fn bad_lines_name_the_line() {
        assert_eq!(
            parse_list("/ok.ko\nrelative.ko\n").unwrap_err().0,
            2,
            "relative path"
        );
        assert_eq!(parse_list("/a/../b.ko").unwrap_err().0, 1);
        assert_eq!(parse_list("/lib/modules/imp/readme.txt").unwrap_err().0, 1);
    }

    #[test]
    fn module_names() {
        assert_eq!(
            module_name(Path::new("/x/vmw_vsock_virtio_transport.ko")),
            "vmw_vsock_virtio_transport"
        );
        assert_eq!(module_name(Path::new("/x/crc32c-intel.ko")), "crc32c_intel");
        assert_eq!(module_name(Path::new("/x/virtio_net.ko.xz")), "virtio_net");
    }

    #[test]
    fn params_from_list_and_cmdline() {
        let words = cmdline::split(
            r#"console=ttyS0 virtio_mmio.device=4K@0xd0000000:5 virtio-mmio.device=4K@0xd0001000:6 virtio_mmiox.y=1 vsock.z ext4.opt="a b" imp.lower=/dev/vda"#,
        )
        .unwrap();
        assert_eq!(
            params_for("virtio_mmio", "", &words),
            "device=4K@0xd0000000:5 device=4K@0xd0001000:6"
        );
        assert_eq!(params_for("vsock", "a=1", &words), "a=1 z");
        assert_eq!(params_for("ext4", "", &words), "opt=\"a b\"");
        assert_eq!(params_for("overlay", "", &words), "");
    }

    #[test]
    fn no_list_means_nothing_to_do() {
        let dir = tempfile::tempdir().unwrap();
        assert!(load_listed(dir.path(), "").unwrap().is_none());
        let list = dir.path().join(LOAD_ORDER);
        std::fs::create_dir_all(list.parent().unwrap()).unwrap();
        std::fs::write(&list, "/lib/modules/imp/missing.ko\n").unwrap();
        let err = load_listed(dir.path(), "").unwrap_err().to_string();
        assert!(err.contains("missing.ko"), "{err}");
    }
}
