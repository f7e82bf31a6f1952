//! The rootfs cache index in the runtime's SQLite: images by content key, per-VM references,
//! and the pure decisions over them (the key itself, which images garbage collection evicts).

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};
use sqlx::Row;
use sqlx::sqlite::SqlitePool;

use super::auth::RegistryAuth;

/// Bumped whenever the way an image is assembled changes (extraction rules, injected files,
/// mkfs options), so old images are never reused for a different recipe.
pub const RECIPE: &str = "imp-rootfs-v1 ext4 -O ^has_journal,^resize_inode -b 4096 -I 256";

/// The cache key: sha256 over the recipe, every layer digest in the order applied (base then
/// runner), and the digest of the injected guest agent. Anything that changes the filesystem
/// changes the key; a registry tag does not, so a retagged identical image is a hit.
pub fn cache_key(layers: &[&str], guest_digest: &str, recipe: &str) -> String {
    // Length-prefixed fields: no two input lists hash the same text.
    let mut h = Sha256::new();
    let mut field = |name: &str, value: &str| {
        h.update(format!("{name} {} {value}\n", value.len()));
    };
    field("recipe", recipe);
    for l in layers {
        field("layer", l);
    }
    field("guest", guest_digest);
    hex::encode(h.finalize())
}

#[derive(Debug, Clone, PartialEq)]
pub struct CacheEntry {
    pub key: String,
    pub path: PathBuf,
    pub bytes: u64,
    pub base_ref: String,
    pub runner_ref: Option<String>,
    pub layers: Vec<String>,
    pub build_seconds: f64,
    pub created_at: i64,
    pub last_used_at: i64,
    /// VMs holding it (from `rootfs_refs`).
    pub refs: u64,
    /// The credentials that built it: `PULLED_ANONYMOUSLY` or `credentials_fingerprint`.
    pub pulled_with: String,
}

/// `pulled_with` of an image every image reference of which was pulled without credentials.
pub const PULLED_ANONYMOUSLY: &str = "anonymous";

/// `pulled_with` for the credentials presented to each image's registry (base, then runner):
/// HMAC-SHA256 under the node's random key, so the index never holds the credentials nor a
/// plain hash one could test guesses against; `PULLED_ANONYMOUSLY` when none were presented.
pub fn credentials_fingerprint(node_key: &[u8], presented: &[&RegistryAuth]) -> String {
    use hmac::Mac as _;
    use imp_common::ExposeSecret as _;
    if presented
        .iter()
        .all(|a| matches!(a, RegistryAuth::Anonymous))
    {
        return PULLED_ANONYMOUSLY.into();
    }
    let mut mac =
        hmac::Hmac::<Sha256>::new_from_slice(node_key).expect("HMAC takes keys of any length");
    // Length-prefixed fields: no two credential lists feed the same bytes.
    let mut field = |value: &[u8]| {
        mac.update(&(value.len() as u64).to_be_bytes());
        mac.update(value);
    };
    for auth in presented {
        match auth {
            RegistryAuth::Anonymous => field(b"anonymous"),
            RegistryAuth::Basic { username, password } => {
                field(b"basic");
                field(username.as_bytes());
                field(password.expose_secret().as_bytes());
            }
        }
    }
    format!("hmac-sha256:{}", hex::encode(mac.finalize().into_bytes()))
}

/// Which images to delete so the cache fits `budget_bytes`: unreferenced ones, least recently
/// used first, never one in `busy` (being built or handed out right now). Referenced images are
/// kept even when the cache stays over budget: a running VM's disk is never pulled from under it.
pub fn plan_gc(entries: &[CacheEntry], budget_bytes: u64, busy: &HashSet<String>) -> Vec<String> {
    let mut total: u64 = entries.iter().map(|e| e.bytes).sum();
    let mut candidates: Vec<&CacheEntry> = entries
        .iter()
        .filter(|e| e.refs == 0 && !busy.contains(&e.key))
        .collect();
    candidates.sort_by(|a, b| {
        (a.last_used_at, &a.key)
            .partial_cmp(&(b.last_used_at, &b.key))
            .expect("total order")
    });
    let mut evict = Vec::new();
    for e in candidates {
        if total <= budget_bytes {
            break;
        }
        total -= e.bytes;
        evict.push(e.key.clone());
    }
    evict
}

/// Milliseconds since the epoch: LRU order must tell apart uses within one second.
pub(crate) fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Rows of `rootfs_images` and `rootfs_refs`.
#[derive(Clone)]
pub struct CacheIndex {
    pool: SqlitePool,
}

/// sqlx takes only `&'static str` queries: the shared SELECT is a macro so each use is a literal.
macro_rules! select {
    ($($tail:literal)?) => {
        concat!(
            "SELECT i.key, i.path, i.bytes, i.base_ref, i.runner_ref, i.layers_json, ",
            "i.build_seconds, i.created_at, i.last_used_at, i.pulled_with, ",
            "(SELECT COUNT(*) FROM rootfs_refs r WHERE r.key = i.key) AS refs FROM rootfs_images i"
            $(, " ", $tail)?
        )
    };
}

fn entry(row: sqlx::sqlite::SqliteRow) -> Result<CacheEntry, sqlx::Error> {
    let layers_json: String = row.try_get("layers_json")?;
    Ok(CacheEntry {
        key: row.try_get("key")?,
        path: PathBuf::from(row.try_get::<String, _>("path")?),
        bytes: row.try_get::<i64, _>("bytes")? as u64,
        base_ref: row.try_get("base_ref")?,
        runner_ref: row.try_get("runner_ref")?,
        layers: serde_json::from_str(&layers_json).map_err(|e| sqlx::Error::ColumnDecode {
            index: "layers_json".into(),
            source: Box::new(e),
        })?,
        build_seconds: row.try_get("build_seconds")?,
        created_at: row.try_get("created_at")?,
        last_used_at: row.try_get("last_used_at")?,
        refs: row.try_get::<i64, _>("refs")? as u64,
        pulled_with: row.try_get("pulled_with")?,
    })
}

impl CacheIndex {
    pub fn new(pool: SqlitePool) -> Self {
        Self { pool }
    }

    pub async fn get(&self, key: &str) -> Result<Option<CacheEntry>, sqlx::Error> {
        sqlx::query(select!("WHERE i.key = ?"))
            .bind(key)
            .fetch_optional(&self.pool)
            .await?
            .map(entry)
            .transpose()
    }

    pub async fn list(&self) -> Result<Vec<CacheEntry>, sqlx::Error> {
        sqlx::query(select!())
            .fetch_all(&self.pool)
            .await?
            .into_iter()
            .map(entry)
            .collect()
    }

    /// The newest image built from, or resolved from, exactly these references, anonymously or
    /// with the credentials `pulled_with` names (`IfNotPresent`, and the offline fallback when
    /// the registry cannot be reached: nothing else proves the request may read the image).
    pub async fn latest_for(
        &self,
        base_ref: &str,
        runner_ref: Option<&str>,
        pulled_with: &str,
    ) -> Result<Option<CacheEntry>, sqlx::Error> {
        sqlx::query(select!(
            "WHERE i.key = (SELECT c.key FROM ( \
               SELECT r.key AS key, r.resolved_at AS at FROM rootfs_resolved r \
                 WHERE r.base_ref = ? AND r.runner_ref = ? AND (r.pulled_with = ? OR r.pulled_with = ?) \
               UNION ALL \
               SELECT b.key AS key, b.created_at AS at FROM rootfs_images b \
                 WHERE b.base_ref = ? AND b.runner_ref IS ? AND (b.pulled_with = ? OR b.pulled_with = ?) \
             ) c JOIN rootfs_images j ON j.key = c.key ORDER BY c.at DESC LIMIT 1)"
        ))
        .bind(base_ref)
        .bind(runner_ref.unwrap_or(""))
        .bind(PULLED_ANONYMOUSLY)
        .bind(pulled_with)
        .bind(base_ref)
        .bind(runner_ref)
        .bind(PULLED_ANONYMOUSLY)
        .bind(pulled_with)
        .fetch_optional(&self.pool)
        .await?
        .map(entry)
        .transpose()
    }

    /// These references, with the credentials `pulled_with` names, resolved at the registry to
    /// image `key` just now.
    pub async fn record_resolved(
        &self,
        base_ref: &str,
        runner_ref: Option<&str>,
        pulled_with: &str,
        key: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT OR REPLACE INTO rootfs_resolved (base_ref, runner_ref, pulled_with, key, resolved_at) \
             VALUES (?, ?, ?, ?, ?)",
        )
        .bind(base_ref)
        .bind(runner_ref.unwrap_or(""))
        .bind(pulled_with)
        .bind(key)
        .bind(now())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn insert(&self, e: &CacheEntry) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO rootfs_images (key, path, bytes, base_ref, runner_ref, layers_json, \
             build_seconds, created_at, last_used_at, pulled_with) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&e.key)
        .bind(e.path.display().to_string())
        .bind(e.bytes as i64)
        .bind(&e.base_ref)
        .bind(&e.runner_ref)
        .bind(serde_json::to_string(&e.layers).expect("strings serialise"))
        .bind(e.build_seconds)
        .bind(e.created_at)
        .bind(e.last_used_at)
        .bind(&e.pulled_with)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// VM `vm_uid` now uses image `key` (a VM holds one image; a repeat is a no-op), and the
    /// image counts as used now.
    pub async fn add_ref(&self, vm_uid: &str, key: &str) -> Result<(), sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("INSERT OR REPLACE INTO rootfs_refs (vm_uid, key) VALUES (?, ?)")
            .bind(vm_uid)
            .bind(key)
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE rootfs_images SET last_used_at = ? WHERE key = ?")
            .bind(now())
            .bind(key)
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    }

    /// Image `key` counts as used now (a pre-build that found it already there).
    pub async fn touch(&self, key: &str) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE rootfs_images SET last_used_at = ? WHERE key = ?")
            .bind(now())
            .bind(key)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Drop VM `vm_uid`'s reference; returns the key it held.
    pub async fn remove_ref(&self, vm_uid: &str) -> Result<Option<String>, sqlx::Error> {
        let key = sqlx::query("DELETE FROM rootfs_refs WHERE vm_uid = ? RETURNING key")
            .bind(vm_uid)
            .fetch_optional(&self.pool)
            .await?
            .map(|r| r.try_get::<String, _>("key"))
            .transpose()?;
        if let Some(k) = &key {
            // Released now: LRU order counts the last VM that used it.
            sqlx::query("UPDATE rootfs_images SET last_used_at = ? WHERE key = ?")
                .bind(now())
                .bind(k)
                .execute(&self.pool)
                .await?;
        }
        Ok(key)
    }

    /// Drop references held by VMs that no longer exist (after a runtime restart).
    pub async fn retain_refs(&self, live_vms: &[String]) -> Result<u64, sqlx::Error> {
        let mut dropped = 0;
        for r in sqlx::query("SELECT vm_uid FROM rootfs_refs")
            .fetch_all(&self.pool)
            .await?
        {
            let uid: String = r.try_get("vm_uid")?;
            if !live_vms.contains(&uid) {
                sqlx::query("DELETE FROM rootfs_refs WHERE vm_uid = ?")
                    .bind(&uid)
                    .execute(&self.pool)
                    .await?;
                dropped += 1;
            }
        }
        Ok(dropped)
    }

    /// Remove an image row, unless a VM took a reference to it meanwhile. True when removed.
    pub async fn delete_unreferenced(&self, key: &str) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(
            "DELETE FROM rootfs_images WHERE key = ? \
             AND NOT EXISTS (SELECT 1 FROM rootfs_refs WHERE key = ?)",
        )
        .bind(key)
        .bind(key)
        .execute(&self.pool)
        .await?;
        if done.rows_affected() != 1 {
            return Ok(false);
        }
        sqlx::query("DELETE FROM rootfs_resolved WHERE key = ?")
            .bind(key)
            .execute(&self.pool)
            .await?;
        Ok(true)
    }

    /// Remove an image row and any references to it (its file is gone).
    pub async fn forget(&self, key: &str) -> Result<(), sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        for table in [
            "DELETE FROM rootfs_refs WHERE key = ?",
            "DELETE FROM rootfs_resolved WHERE key = ?",
        ] {
            sqlx::query(table).bind(key).execute(&mut *tx).await?;
        }
        sqlx::query("DELETE FROM rootfs_images WHERE key = ?")
            .bind(key)
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(key: &str, bytes: u64, last_used_at: i64, refs: u64) -> CacheEntry {
        CacheEntry {
            key: key.into(),
            path: PathBuf::from(format!("/c/{key}.ext4")),
            bytes,
            base_ref: "r/base:1".into(),
            runner_ref: None,
            layers: vec!["sha256:aa".into()],
            build_seconds: 1.0,
            created_at: 0,
            last_used_at,
            refs,
            pulled_with: PULLED_ANONYMOUSLY.into(),
        }
    }

    #[test]
    fn key_depends_on_every_input_and_on_layer_order() {
        let k = cache_key(&["sha256:a", "sha256:b"], "sha256:g", RECIPE);
        assert_eq!(k.len(), 64);
        assert_eq!(k, cache_key(&["sha256:a", "sha256:b"], "sha256:g", RECIPE));
        for other in [
            cache_key(&["sha256:b", "sha256:a"], "sha256:g", RECIPE),
            cache_key(&["sha256:a"], "sha256:g", RECIPE),
            cache_key(&["sha256:a", "sha256:b", "sha256:c"], "sha256:g", RECIPE),
            cache_key(&["sha256:a", "sha256:b"], "sha256:h", RECIPE),
            cache_key(&["sha256:a", "sha256:b"], "sha256:g", "imp-rootfs-v2"),
            // No ambiguity from concatenation.
            cache_key(&["sha256:a\nlayer sha256:b"], "sha256:g", RECIPE),
        ] {
            assert_ne!(k, other);
        }
    }

    #[test]
    fn gc_evicts_least_recently_used_unreferenced_until_under_budget() {
        let entries = [
            e("old", 100, 1, 0),
            e("mid", 100, 2, 0),
            e("new", 100, 3, 0),
            e("held", 100, 0, 2),
        ];
        let none = HashSet::new();
        assert!(plan_gc(&entries, 400, &none).is_empty());
        assert_eq!(plan_gc(&entries, 300, &none), ["old"]);
        assert_eq!(plan_gc(&entries, 150, &none), ["old", "mid", "new"]);
        // Referenced images stay even when that leaves the cache over budget.
        assert_eq!(plan_gc(&entries, 0, &none), ["old", "mid", "new"]);
        // Busy (being handed out) images are skipped; the next candidate goes instead.
        let busy = HashSet::from(["old".to_string()]);
        assert_eq!(plan_gc(&entries, 300, &busy), ["mid"]);
    }

    #[test]
    fn credentials_fingerprint_is_keyed_and_names_the_credentials_only_by_hash() {
        let basic = |u: &str, p: &str| RegistryAuth::Basic {
            username: u.into(),
            password: imp_common::SecretString::from(p),
        };
        let anon = RegistryAuth::Anonymous;
        assert_eq!(
            credentials_fingerprint(b"k", &[&anon, &anon]),
            PULLED_ANONYMOUSLY
        );
        let a = credentials_fingerprint(b"k", &[&basic("a", "pw-1")]);
        assert!(a.starts_with("hmac-sha256:") && !a.contains("pw-1"), "{a}");
        assert_eq!(a, credentials_fingerprint(b"k", &[&basic("a", "pw-1")]));
        for other in [
            credentials_fingerprint(b"k2", &[&basic("a", "pw-1")]),
            credentials_fingerprint(b"k", &[&basic("a", "pw-2")]),
            credentials_fingerprint(b"k", &[&basic("b", "pw-1")]),
            credentials_fingerprint(b"k", &[&basic("ap", "w-1")]),
            credentials_fingerprint(b"k", &[&anon, &basic("a", "pw-1")]),
        ] {
            assert_ne!(a, other);
        }
    }

    #[tokio::test]
    async fn offline_lookup_serves_anonymous_builds_and_matching_credentials_only() {
        let d = tempfile::tempdir().unwrap();
        let inv = crate::inventory::Inventory::open(d.path()).await.unwrap();
        let idx = CacheIndex::new(inv.pool().clone());
        idx.insert(&CacheEntry {
            pulled_with: "hmac-sha256:aa".into(),
            ..e("private", 10, 1, 0)
        })
        .await
        .unwrap();
        let hit = |pw: &'static str| {
            let idx = idx.clone();
            async move {
                idx.latest_for("r/base:1", None, pw)
                    .await
                    .unwrap()
                    .map(|e| e.key)
            }
        };
        assert_eq!(hit("hmac-sha256:aa").await.as_deref(), Some("private"));
        assert_eq!(hit(PULLED_ANONYMOUSLY).await, None);
        assert_eq!(hit("hmac-sha256:bb").await, None);
        idx.insert(&CacheEntry {
            created_at: -1,
            ..e("public", 10, 1, 0)
        })
        .await
        .unwrap();
        assert_eq!(hit(PULLED_ANONYMOUSLY).await.as_deref(), Some("public"));
        assert_eq!(hit("hmac-sha256:bb").await.as_deref(), Some("public"));
        assert_eq!(hit("hmac-sha256:aa").await.as_deref(), Some("private"));
        inv.close().await;
    }

    #[tokio::test]
    async fn a_resolution_by_other_references_or_credentials_is_found_by_them_only() {
        let d = tempfile::tempdir().unwrap();
        let inv = crate::inventory::Inventory::open(d.path()).await.unwrap();
        let idx = CacheIndex::new(inv.pool().clone());
        idx.insert(&CacheEntry {
            pulled_with: "hmac-sha256:aa".into(),
            ..e("k", 10, 1, 0)
        })
        .await
        .unwrap();
        let key = |base: &'static str, runner: Option<&'static str>, pw: &'static str| {
            let idx = idx.clone();
            async move {
                idx.latest_for(base, runner, pw)
                    .await
                    .unwrap()
                    .map(|e| e.key)
            }
        };
        assert_eq!(key("r/retag:2", None, "hmac-sha256:aa").await, None);
        idx.record_resolved("r/retag:2", None, "hmac-sha256:bb", "k")
            .await
            .unwrap();
        assert_eq!(
            key("r/retag:2", None, "hmac-sha256:bb").await.as_deref(),
            Some("k")
        );
        for (base, runner, pw) in [
            ("r/retag:2", None, "hmac-sha256:aa"),
            ("r/retag:2", None, PULLED_ANONYMOUSLY),
            ("r/retag:2", Some("r/runner:1"), "hmac-sha256:bb"),
        ] {
            assert_eq!(key(base, runner, pw).await, None, "{base} {runner:?} {pw}");
        }
        // The builder's own references still count; an image gone takes its resolutions along.
        assert_eq!(
            key("r/base:1", None, "hmac-sha256:aa").await.as_deref(),
            Some("k")
        );
        assert!(idx.delete_unreferenced("k").await.unwrap());
        assert_eq!(key("r/retag:2", None, "hmac-sha256:bb").await, None);
        let left: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM rootfs_resolved")
            .fetch_one(inv.pool())
            .await
            .unwrap();
        assert_eq!(left, 0);
        inv.close().await;
    }

    #[test]
    fn gc_ties_on_last_use_break_by_key() {
        let entries = [e("b", 10, 5, 0), e("a", 10, 5, 0)];
        assert_eq!(plan_gc(&entries, 10, &HashSet::new()), ["a"]);
    }

    #[tokio::test]
    async fn index_counts_references_and_survives_reopen() {
        let d = tempfile::tempdir().unwrap();
        let inv = crate::inventory::Inventory::open(d.path()).await.unwrap();
        let idx = CacheIndex::new(inv.pool().clone());
        idx.insert(&e("k1", 10, 1, 0)).await.unwrap();
        idx.insert(&CacheEntry {
            created_at: 5,
            ..e("k2", 20, 1, 0)
        })
        .await
        .unwrap();
        idx.add_ref("vm-a", "k1").await.unwrap();
        idx.add_ref("vm-b", "k1").await.unwrap();
        idx.add_ref("vm-b", "k1").await.unwrap();
        assert_eq!(idx.get("k1").await.unwrap().unwrap().refs, 2);
        assert!(idx.get("k1").await.unwrap().unwrap().last_used_at > 1);
        assert!(!idx.delete_unreferenced("k1").await.unwrap());
        let latest = idx
            .latest_for("r/base:1", None, "x")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(latest.key, "k2");
        assert!(
            idx.latest_for("r/base:1", Some("r/runner:1"), "x")
                .await
                .unwrap()
                .is_none()
        );
        inv.close().await;

        let inv = crate::inventory::Inventory::open(d.path()).await.unwrap();
        let idx = CacheIndex::new(inv.pool().clone());
        assert_eq!(idx.get("k1").await.unwrap().unwrap().refs, 2);
        assert_eq!(idx.retain_refs(&["vm-a".into()]).await.unwrap(), 1);
        assert_eq!(idx.remove_ref("vm-a").await.unwrap().as_deref(), Some("k1"));
        assert_eq!(idx.remove_ref("vm-a").await.unwrap(), None);
        assert!(idx.delete_unreferenced("k1").await.unwrap());
        idx.add_ref("vm-c", "k2").await.unwrap();
        idx.forget("k2").await.unwrap();
        assert!(idx.list().await.unwrap().is_empty());
    }
}
