-- The VMM backend that runs a VM (firecracker | qemu): reattach and stop speak its protocol.
ALTER TABLE vms ADD COLUMN backend TEXT NOT NULL DEFAULT 'firecracker';
-- A helper process the VM needs beside its VMM (QEMU's vhost-device-vsock), same identity
-- rule as pid/start_time.
ALTER TABLE vms ADD COLUMN helper_pid INTEGER;
ALTER TABLE vms ADD COLUMN helper_start_time INTEGER;
