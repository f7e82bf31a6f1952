-- Which credentials built an image: 'anonymous', or 'hmac-sha256:<hex>' of the credentials
-- presented (keyed with the node's rootfs/credentials.key; never the credentials themselves).
-- The offline fallback serves an image only to the same credentials, or anyone when anonymous.
-- Rows from before are 'unknown': never served offline.
ALTER TABLE rootfs_images ADD COLUMN pulled_with TEXT NOT NULL DEFAULT 'unknown';
