-- The rootfs cache index (node/src/rootfs/cache.rs): one row per built base image, keyed by the
-- hash of every input that changes its filesystem.
CREATE TABLE rootfs_images (
    key           TEXT PRIMARY KEY NOT NULL,
    path          TEXT NOT NULL,
    -- Size of the image file, counted against the cache budget.
    bytes         INTEGER NOT NULL,
    -- The references it was built from (for the offline fallback and for operators).
    base_ref      TEXT NOT NULL,
    runner_ref    TEXT,
    layers_json   TEXT NOT NULL,
    build_seconds REAL NOT NULL,
    -- Milliseconds since the epoch.
    created_at    INTEGER NOT NULL,
    last_used_at  INTEGER NOT NULL
);

-- Which VM holds which image: a reference count that survives restarts and can be reconciled
-- with the VM inventory (a VM uses exactly one base image).
CREATE TABLE rootfs_refs (
    vm_uid TEXT PRIMARY KEY NOT NULL,
    key    TEXT NOT NULL REFERENCES rootfs_images(key)
);
CREATE INDEX rootfs_refs_key ON rootfs_refs(key);
