-- How a VM was started (VmStatus.start: booted or cloned from a template, the fallback reason
-- of a from_template VM that booted, restore and reidentify seconds), as JSON; NULL for rows
-- of runtimes that predate templates and while Creating.
ALTER TABLE vms ADD COLUMN start_json TEXT;
