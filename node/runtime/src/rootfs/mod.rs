//! Root filesystems from OCI images (ARCHITECTURE §6): pull and verify blobs (`pull`, `auth`)
//! through a proxy that keeps pulls off the node's own addresses (`egress`),
//! apply layers safely into a work directory (`flatten`), build a read-only ext4 base (`ext4`),
//! cache it by content key with reference counts and LRU garbage collection (`cache`), and make
//! the per-VM writable drive in O(1) (`writable`). docs/rootfs.md describes the whole pipeline.

/// Registry credentials: the wire form lives in the contract crate (the agent sends it).
pub use imp_runtime_api::auth;
pub mod cache;
pub mod egress;
pub mod ext4;
pub mod flatten;
pub mod pull;
pub mod store;
pub mod writable;

use serde::{Deserialize, Serialize};

/// How a layer blob is compressed, from its OCI (or Docker v2) media type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    /// The layer media types Imp unpacks; anything else (foreign or non-distributable layers,
    /// encrypted layers, artifacts) is refused by the caller with the media type named.
    pub fn from_media_type(media_type: &str) -> Option<Self> {
        match media_type {
            "application/vnd.oci.image.layer.v1.tar"
            | "application/vnd.docker.image.rootfs.diff.tar" => Some(Compression::None),
            "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip" => Some(Compression::Gzip),
            "application/vnd.oci.image.layer.v1.tar+zstd"
            | "application/vnd.docker.image.rootfs.diff.tar.zstd" => Some(Compression::Zstd),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn media_types() {
        assert_eq!(
            Compression::from_media_type("application/vnd.oci.image.layer.v1.tar+gzip"),
            Some(Compression::Gzip)
        );
        assert_eq!(
            Compression::from_media_type("application/vnd.docker.image.rootfs.diff.tar.gzip"),
            Some(Compression::Gzip)
        );
        assert_eq!(
            Compression::from_media_type("application/vnd.oci.image.layer.v1.tar+zstd"),
            Some(Compression::Zstd)
        );
        assert_eq!(
            Compression::from_media_type("application/vnd.oci.image.layer.v1.tar"),
            Some(Compression::None)
        );
        for refused in [
            "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
            "application/vnd.oci.image.config.v1+json",
            "application/octet-stream",
            "",
        ] {
            assert_eq!(Compression::from_media_type(refused), None, "{refused}");
        }
    }
}
