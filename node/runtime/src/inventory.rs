//! The runtime's inventory: one SQLite row per VM (WAL, migrations from node/runtime/migrations), the
//! source of truth for reattach after a restart.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::api::{Backend, VmState};
use sqlx::Row;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};

#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    #[error("open the inventory {path}: {source}")]
    Open { path: PathBuf, source: sqlx::Error },
    #[error("migrate the inventory: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("inventory query: {0}")]
    Query(#[from] sqlx::Error),
    #[error("inventory row for {uid} has unknown state {state:?}")]
    BadState { uid: String, state: String },
    #[error("inventory row for {uid} has unknown VMM backend {backend:?}")]
    BadBackend { uid: String, backend: String },
}

#[derive(Debug, Clone, PartialEq)]
pub struct VmRecord {
    pub uid: String,
    pub state: VmState,
    pub spec_json: String,
    pub pid: Option<i32>,
    pub start_time: Option<u64>,
    pub dir: PathBuf,
    pub api_socket: PathBuf,
    pub vsock_path: PathBuf,
    pub serial_log: PathBuf,
    pub tap: Option<String>,
    pub base_disk: PathBuf,
    pub writable_disk: Option<PathBuf>,
    pub failure_reason: Option<String>,
    pub failure_message: Option<String>,
    pub boot_seconds: Option<f64>,
    pub backend: Backend,
    /// A process the VM needs beside its VMM (QEMU's vhost-device-vsock).
    pub helper_pid: Option<i32>,
    pub helper_start_time: Option<u64>,
    /// How the VM was started (`VmStatus.start`, JSON), recorded once it is Running or Failed.
    pub start_json: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Inventory {
    pool: SqlitePool,
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

fn path_str(p: &Path) -> String {
    p.display().to_string()
}

impl Inventory {
    /// Open (creating if needed) `<state_dir>/inventory.db` in WAL mode and apply migrations.
    pub async fn open(state_dir: &Path) -> Result<Self, InventoryError> {
        let path = state_dir.join("inventory.db");
        let opts = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // WAL + NORMAL is durable across a process crash (the kill -9 case); only power
            // loss may drop the last transactions.
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(std::time::Duration::from_secs(5));
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(opts)
            .await
            .map_err(|source| InventoryError::Open { path, source })?;
        sqlx::migrate!("./migrations").run(&pool).await?;
        Ok(Self { pool })
    }

    /// The database, shared with the rootfs cache index (same file, same migrations).
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    pub async fn close(&self) {
        self.pool.close().await;
    }

    pub async fn insert(&self, r: &VmRecord) -> Result<(), InventoryError> {
        sqlx::query(
            "INSERT INTO vms (uid, state, spec_json, pid, start_time, dir, api_socket, vsock_path, \
             serial_log, tap, base_disk, writable_disk, failure_reason, failure_message, boot_seconds, \
             created_at, updated_at, backend, helper_pid, helper_start_time, start_json) \
             VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        )
        .bind(r.uid.clone())
        .bind(r.state.as_str())
        .bind(r.spec_json.clone())
        .bind(r.pid)
        .bind(r.start_time.map(|s| s as i64))
        .bind(path_str(&r.dir))
        .bind(path_str(&r.api_socket))
        .bind(path_str(&r.vsock_path))
        .bind(path_str(&r.serial_log))
        .bind(r.tap.clone())
        .bind(path_str(&r.base_disk))
        .bind(r.writable_disk.as_deref().map(path_str))
        .bind(r.failure_reason.clone())
        .bind(r.failure_message.clone())
        .bind(r.boot_seconds)
        .bind(now())
        .bind(now())
        .bind(r.backend.as_str())
        .bind(r.helper_pid)
        .bind(r.helper_start_time.map(|s| s as i64))
        .bind(r.start_json.clone())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The VM's helper process (recorded as soon as it is spawned, like the VMM).
    pub async fn set_helper(
        &self,
        uid: &str,
        pid: i32,
        start_time: u64,
    ) -> Result<(), InventoryError> {
        sqlx::query(
            "UPDATE vms SET helper_pid = ?, helper_start_time = ?, updated_at = ? WHERE uid = ?",
        )
        .bind(pid)
        .bind(start_time as i64)
        .bind(now())
        .bind(uid.to_string())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn set_process(
        &self,
        uid: &str,
        pid: i32,
        start_time: u64,
    ) -> Result<(), InventoryError> {
        sqlx::query("UPDATE vms SET pid = ?, start_time = ?, updated_at = ? WHERE uid = ?")
            .bind(pid)
            .bind(start_time as i64)
            .bind(now())
            .bind(uid.to_string())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// A Suspended VM has no process (nor helper): its VMM was stopped after the snapshot.
    pub async fn set_suspended(&self, uid: &str) -> Result<(), InventoryError> {
        sqlx::query(
            "UPDATE vms SET state = 'Suspended', pid = NULL, start_time = NULL, helper_pid = NULL, \
             helper_start_time = NULL, updated_at = ? WHERE uid = ?",
        )
        .bind(now())
        .bind(uid.to_string())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The base image the rootfs cache handed out (for image-built VMs, known after insert).
    pub async fn set_base_disk(&self, uid: &str, path: &Path) -> Result<(), InventoryError> {
        sqlx::query("UPDATE vms SET base_disk = ?, updated_at = ? WHERE uid = ?")
            .bind(path_str(path))
            .bind(now())
            .bind(uid)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn set_state(&self, uid: &str, state: VmState) -> Result<(), InventoryError> {
        sqlx::query("UPDATE vms SET state = ?, updated_at = ? WHERE uid = ?")
            .bind(state.as_str())
            .bind(now())
            .bind(uid.to_string())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn set_running(&self, uid: &str, boot_seconds: f64) -> Result<(), InventoryError> {
        sqlx::query(
            "UPDATE vms SET state = 'Running', boot_seconds = ?, updated_at = ? WHERE uid = ?",
        )
        .bind(boot_seconds)
        .bind(now())
        .bind(uid.to_string())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn set_failed(
        &self,
        uid: &str,
        reason: &str,
        message: &str,
    ) -> Result<(), InventoryError> {
        sqlx::query(
            "UPDATE vms SET state = 'Failed', failure_reason = ?, failure_message = ?, updated_at = ? \
             WHERE uid = ?",
        )
        .bind(reason.to_string())
        .bind(message.to_string())
        .bind(now())
        .bind(uid.to_string())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// How the VM was started (`VmStatus.start`, as JSON).
    pub async fn set_start(&self, uid: &str, start_json: &str) -> Result<(), InventoryError> {
        sqlx::query("UPDATE vms SET start_json = ?, updated_at = ? WHERE uid = ?")
            .bind(start_json.to_string())
            .bind(now())
            .bind(uid.to_string())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn get(&self, uid: &str) -> Result<Option<VmRecord>, InventoryError> {
        let row = sqlx::query("SELECT * FROM vms WHERE uid = ?")
            .bind(uid.to_string())
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| decode(&r)).transpose()
    }

    pub async fn list(&self) -> Result<Vec<VmRecord>, InventoryError> {
        let rows = sqlx::query("SELECT * FROM vms ORDER BY created_at, uid")
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(decode).collect()
    }

    pub async fn delete(&self, uid: &str) -> Result<(), InventoryError> {
        sqlx::query("DELETE FROM vms WHERE uid = ?")
            .bind(uid.to_string())
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

fn decode(r: &SqliteRow) -> Result<VmRecord, InventoryError> {
    let uid: String = r.try_get("uid")?;
    let state: String = r.try_get("state")?;
    let state = state.parse().map_err(|_| InventoryError::BadState {
        uid: uid.clone(),
        state,
    })?;
    let path =
        |c: &str| -> Result<PathBuf, sqlx::Error> { r.try_get::<String, _>(c).map(PathBuf::from) };
    Ok(VmRecord {
        state,
        spec_json: r.try_get("spec_json")?,
        pid: r.try_get("pid")?,
        start_time: r.try_get::<Option<i64>, _>("start_time")?.map(|s| s as u64),
        dir: path("dir")?,
        api_socket: path("api_socket")?,
        vsock_path: path("vsock_path")?,
        serial_log: path("serial_log")?,
        tap: r.try_get("tap")?,
        base_disk: path("base_disk")?,
        writable_disk: r
            .try_get::<Option<String>, _>("writable_disk")?
            .map(PathBuf::from),
        failure_reason: r.try_get("failure_reason")?,
        failure_message: r.try_get("failure_message")?,
        boot_seconds: r.try_get("boot_seconds")?,
        backend: {
            let b: String = r.try_get("backend")?;
            b.parse().map_err(|_| InventoryError::BadBackend {
                uid: uid.clone(),
                backend: b,
            })?
        },
        helper_pid: r.try_get("helper_pid")?,
        helper_start_time: r
            .try_get::<Option<i64>, _>("helper_start_time")?
            .map(|s| s as u64),
        start_json: r.try_get("start_json")?,
        uid,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use imp_api::names::reason;

    fn record(uid: &str, dir: &Path) -> VmRecord {
        VmRecord {
            uid: uid.into(),
            state: VmState::Creating,
            spec_json: "{}".into(),
            pid: None,
            start_time: None,
            dir: dir.join(uid),
            api_socket: dir.join(uid).join("api.sock"),
            vsock_path: dir.join(uid).join("vsock.sock"),
            serial_log: dir.join(uid).join("serial.log"),
            tap: Some("impt0".into()),
            base_disk: "/base.ext4".into(),
            writable_disk: None,
            backend: Backend::Firecracker,
            helper_pid: None,
            helper_start_time: None,
            start_json: None,
            failure_reason: None,
            failure_message: None,
            boot_seconds: None,
        }
    }

    #[tokio::test]
    async fn rows_survive_reopen_in_wal_mode() {
        let dir = tempfile::tempdir().unwrap();
        let inv = Inventory::open(dir.path()).await.unwrap();
        inv.insert(&record("a", dir.path())).await.unwrap();
        inv.insert(&record("b", dir.path())).await.unwrap();
        inv.set_process("a", 42, 777).await.unwrap();
        inv.set_running("a", 0.25).await.unwrap();
        inv.set_failed("b", reason::KERNEL_MISSING, "no kernel")
            .await
            .unwrap();
        inv.close().await;

        let inv = Inventory::open(dir.path()).await.unwrap();
        let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
            .fetch_one(&inv.pool)
            .await
            .unwrap();
        assert_eq!(mode, "wal");
        let a = inv.get("a").await.unwrap().unwrap();
        assert_eq!(
            (a.state, a.pid, a.start_time, a.boot_seconds),
            (VmState::Running, Some(42), Some(777), Some(0.25))
        );
        let b = inv.get("b").await.unwrap().unwrap();
        assert_eq!(b.state, VmState::Failed);
        assert_eq!(b.failure_reason.as_deref(), Some(reason::KERNEL_MISSING));
        assert_eq!(inv.list().await.unwrap().len(), 2);
        inv.delete("a").await.unwrap();
        assert!(inv.get("a").await.unwrap().is_none());
        assert!(
            inv.insert(&record("b", dir.path())).await.is_err(),
            "uid is the primary key"
        );
    }
}
