//! The contract between imp-agent and imp-runtime (docs/runtime.md): the bodies of the runtime's
//! socket API ([`api`]) and the client that sends them ([`client`]), plus the few types both sides
//! build from Kubernetes objects: the image request ([`image`]), registry pull credentials
//! ([`auth`]) and a VM's network ([`network`]). The agent depends on this crate only, never on
//! imp-runtime, so it links no VMM driver, netlink, SQLite or OCI client.

pub mod api;
pub mod auth;
pub mod client;
pub mod image;
pub mod network;
