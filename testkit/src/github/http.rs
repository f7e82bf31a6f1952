//! The tiny plain-HTTP/1.1 JSON client used to deliver webhooks and by [`super::AdminClient`]:
//! the fake runner's (imp-fake-runner crate), so there is one.

pub use imp_fake_runner::http::{HttpClient, HttpResponse};
