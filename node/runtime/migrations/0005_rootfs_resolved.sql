-- Which image a pair of references resolved to, and with which credentials (same form as
-- rootfs_images.pulled_with): the registry accepted those credentials for those references.
-- `IfNotPresent` and the offline fallback hand out an image by reference from here (or from the
-- references an image was built from) to the same credentials, or to anyone when anonymous; a
-- retag of cached content is found without asking the registry again.
CREATE TABLE rootfs_resolved (
    base_ref    TEXT NOT NULL,
    -- '' when there is no runner image (a primary key column cannot hold NULL usefully).
    runner_ref  TEXT NOT NULL,
    pulled_with TEXT NOT NULL,
    key         TEXT NOT NULL,
    -- Milliseconds since the epoch: the newest resolution wins.
    resolved_at INTEGER NOT NULL,
    PRIMARY KEY (base_ref, runner_ref, pulled_with)
);
CREATE INDEX rootfs_resolved_key ON rootfs_resolved(key);
