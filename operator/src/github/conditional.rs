//! Conditional requests: GitHub answers a GET whose `If-None-Match` names the current `ETag` with
//! 304 Not Modified and does not charge it to the installation's rate limit. [`EtagCache`] remembers
//! the last answer of each listed path (bounded, least recently used first out) so a 304 can be
//! served from it; [`CallCount`] says what a listing cost.

use std::collections::HashMap;

use bytes::Bytes;
use http::HeaderValue;

/// What a series of calls cost: `charged` answers spent the rate limit, `revalidated` ones (304)
/// did not. `first` of the charged had no remembered answer to revalidate (a cold cache: the first
/// sweep after a start, or new repositories and runs); the budget treats them as a one-time cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallCount {
    pub charged: u64,
    pub revalidated: u64,
    pub first: u64,
}

impl CallCount {
    pub fn total(&self) -> u64 {
        self.charged + self.revalidated
    }

    pub fn add(&mut self, other: CallCount) {
        self.charged += other.charged;
        self.revalidated += other.revalidated;
        self.first += other.first;
    }
}

/// A remembered answer: its ETag, body and `Link` header (pagination must survive a 304).
#[derive(Debug, Clone)]
pub struct Cached {
    pub etag: HeaderValue,
    pub body: Bytes,
    pub link: Option<HeaderValue>,
    used: u64,
}

/// Last answers by request path, at most `max_entries`.
#[derive(Debug)]
pub struct EtagCache {
    max_entries: usize,
    tick: u64,
    entries: HashMap<String, Cached>,
}

/// Enough for the run and job listings of a few thousand repositories.
pub const DEFAULT_ETAG_ENTRIES: usize = 20_000;

impl Default for EtagCache {
    fn default() -> Self {
        Self::new(DEFAULT_ETAG_ENTRIES)
    }
}

impl EtagCache {
    pub fn new(max_entries: usize) -> Self {
        EtagCache {
            max_entries: max_entries.max(1),
            tick: 0,
            entries: HashMap::new(),
        }
    }

    /// The ETag to send for `path`, if an answer is remembered.
    pub fn etag(&self, path: &str) -> Option<HeaderValue> {
        self.entries.get(path).map(|c| c.etag.clone())
    }

    /// The remembered answer, after a 304 confirmed it.
    pub fn revalidated(&mut self, path: &str) -> Option<Cached> {
        self.tick += 1;
        let tick = self.tick;
        let c = self.entries.get_mut(path)?;
        c.used = tick;
        Some(c.clone())
    }

    /// Remembers a 200 answer; evicts the least recently used tenth when full.
    pub fn store(&mut self, path: &str, etag: HeaderValue, body: Bytes, link: Option<HeaderValue>) {
        self.tick += 1;
        if !self.entries.contains_key(path) && self.entries.len() >= self.max_entries {
            let mut ages: Vec<(u64, String)> = self
                .entries
                .iter()
                .map(|(k, c)| (c.used, k.clone()))
                .collect();
            ages.sort_unstable();
            let n = (self.max_entries / 10).max(1);
            for (_, k) in ages.into_iter().take(n) {
                self.entries.remove(&k);
            }
        }
        self.entries.insert(
            path.to_owned(),
            Cached {
                etag,
                body,
                link,
                used: self.tick,
            },
        );
    }

    /// A path whose answer is no longer valid (an error answer, a 304 without a remembered body).
    pub fn forget(&mut self, path: &str) {
        self.entries.remove(path);
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &'static str) -> HeaderValue {
        HeaderValue::from_static(s)
    }

    #[test]
    fn a_stored_answer_is_revalidated_with_its_etag_and_link() {
        let mut c = EtagCache::new(10);
        assert_eq!(c.etag("/a"), None);
        c.store(
            "/a",
            v("W/\"1\""),
            Bytes::from_static(b"{}"),
            Some(v("<x>")),
        );
        assert_eq!(c.etag("/a"), Some(v("W/\"1\"")));
        let hit = c.revalidated("/a").unwrap();
        assert_eq!(hit.body, Bytes::from_static(b"{}"));
        assert_eq!(hit.link, Some(v("<x>")));
        c.store("/a", v("W/\"2\""), Bytes::from_static(b"[]"), None);
        assert_eq!(c.etag("/a"), Some(v("W/\"2\"")));
        assert_eq!(c.len(), 1);
        c.forget("/a");
        assert!(c.is_empty() && c.revalidated("/a").is_none());
    }

    #[test]
    fn the_cache_is_bounded_and_keeps_recently_used_entries() {
        let mut c = EtagCache::new(20);
        for i in 0..20 {
            c.store(&format!("/{i}"), v("e"), Bytes::new(), None);
        }
        // /0 is used again, so /1 and /2 are the oldest.
        c.revalidated("/0");
        c.store("/new", v("e"), Bytes::new(), None);
        assert_eq!(c.len(), 19);
        assert!(c.etag("/0").is_some() && c.etag("/new").is_some());
        assert!(c.etag("/1").is_none() && c.etag("/2").is_none());
        for i in 0..1000 {
            c.store(&format!("/x{i}"), v("e"), Bytes::new(), None);
        }
        assert!(c.len() <= 20);
    }

    #[test]
    fn call_counts_add_up() {
        let mut a = CallCount {
            charged: 2,
            revalidated: 3,
            first: 1,
        };
        a.add(CallCount {
            charged: 1,
            revalidated: 0,
            first: 1,
        });
        assert_eq!((a.charged, a.revalidated, a.first, a.total()), (3, 3, 2, 6));
    }
}
