-- One row per VM this runtime owns, written before anything is created on the host so a
-- restart can always find (and finish or undo) what a crashed runtime started.
CREATE TABLE vms (
    uid             TEXT PRIMARY KEY NOT NULL,
    -- Creating | Booting | Running | Failed | Exited
    state           TEXT NOT NULL,
    -- The resolved spec from PUT /v1/vms/{uid}, JSON; a PUT with another spec is a conflict.
    spec_json       TEXT NOT NULL,
    -- Firecracker process identity: pid plus start time (clock ticks since boot, /proc/<pid>/stat
    -- field 22) so a recycled pid is never taken for the VM.
    pid             INTEGER,
    start_time      INTEGER,
    dir             TEXT NOT NULL,
    api_socket      TEXT NOT NULL,
    vsock_path      TEXT NOT NULL,
    serial_log      TEXT NOT NULL,
    tap             TEXT,
    base_disk       TEXT NOT NULL,
    writable_disk   TEXT,
    failure_reason  TEXT,
    failure_message TEXT,
    boot_seconds    REAL,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL
);
