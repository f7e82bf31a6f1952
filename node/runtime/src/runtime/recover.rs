//! The pure half of the startup reconciliation after a runtime restart (or crash): what to do
//! with each inventory row given what the host says about its VMM process, which VMM
//! processes under the state dir are orphans, and which VM directories have no row.

use std::path::{Path, PathBuf};

use crate::api::VmState;

/// What the host says about a row's VMM process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Process {
    /// The row has no pid (the start never got that far).
    NotRecorded,
    /// pid + start time no longer name a live process.
    Gone,
    /// Alive and answering its control socket.
    Answering,
    /// Alive, and its control socket does not answer (or was not asked: only Running rows
    /// are, see [`needs_probe`]).
    Silent,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowAction {
    /// Nothing to do (a settled Failed or Exited row: the agent reads it, then deletes it).
    Keep,
    /// A running VM: keep its process, serve it again.
    Reattach,
    /// The VM ended while the runtime was down.
    MarkExited,
    /// A hung VMM: kill it, release its host resources, record the failure.
    KillAndFail,
    /// A start interrupted by the restart: kill what was spawned, release everything, delete
    /// the row, so the agent's next PUT starts afresh.
    CleanUp,
    /// A suspend interrupted before its snapshot was recorded complete: the VMM still runs
    /// (paused): resume it and serve it as Running again.
    ResumeRunning,
    /// A Suspended row whose VMM outlived the suspend (the runtime died between recording the
    /// snapshot and killing the VMM): kill it; the row stays Suspended.
    KillKeepSuspended,
    /// A resume interrupted before its VMM was spawned: the snapshot is untouched, the row goes
    /// back to Suspended.
    BackToSuspended,
}

pub fn row_action(state: VmState, process: Process) -> RowAction {
    match (state, process) {
        // A resume whose VMM answers loaded the snapshot and ran: its disks moved past the
        // snapshot, so it is served as Running, never rolled back.
        (VmState::Running | VmState::Resuming, Process::Answering) => RowAction::Reattach,
        (VmState::Running, Process::NotRecorded | Process::Gone) => RowAction::MarkExited,
        (VmState::Running | VmState::Suspending | VmState::Resuming, Process::Silent) => {
            RowAction::KillAndFail
        }
        (VmState::Creating | VmState::Booting, _) => RowAction::CleanUp,
        (VmState::Failed | VmState::Exited, _) => RowAction::Keep,
        (VmState::Suspended, Process::NotRecorded | Process::Gone) => RowAction::Keep,
        (VmState::Suspended, Process::Answering | Process::Silent) => RowAction::KillKeepSuspended,
        (VmState::Suspending, Process::Answering) => RowAction::ResumeRunning,
        // The VMM died before the snapshot was recorded complete: the VM is lost.
        (VmState::Suspending | VmState::Resuming, Process::Gone) => RowAction::MarkExited,
        (VmState::Suspending, Process::NotRecorded) => RowAction::MarkExited,
        (VmState::Resuming, Process::NotRecorded) => RowAction::BackToSuspended,
    }
}

/// Whether the recovery needs to ask the process's control socket (a live process of a
/// Running, Suspending or Resuming row is decided on the answer).
pub fn needs_probe(state: VmState) -> bool {
    matches!(
        state,
        VmState::Running | VmState::Suspending | VmState::Resuming
    )
}

/// VMM processes found under the state dir that no kept row owns (spawned just before a crash
/// recorded them, or left by a row that was cleaned up): to be killed.
pub fn orphans<T: Clone>(found: &[(i32, u64, T)], kept: &[(i32, u64)]) -> Vec<(i32, u64, T)> {
    found
        .iter()
        .filter(|(pid, start, _)| !kept.contains(&(*pid, *start)))
        .cloned()
        .collect()
}

/// Entries of `vms/` that belong to no row: to be removed.
pub fn stray_dirs(entries: &[PathBuf], known: &[&Path]) -> Vec<PathBuf> {
    entries
        .iter()
        .filter(|e| !known.contains(&e.as_path()))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_rows_are_reattached_only_when_their_process_answers() {
        assert_eq!(
            row_action(VmState::Running, Process::Answering),
            RowAction::Reattach
        );
        assert_eq!(
            row_action(VmState::Running, Process::Gone),
            RowAction::MarkExited
        );
        assert_eq!(
            row_action(VmState::Running, Process::NotRecorded),
            RowAction::MarkExited
        );
        assert_eq!(
            row_action(VmState::Running, Process::Silent),
            RowAction::KillAndFail
        );
    }

    #[test]
    fn interrupted_starts_are_cleaned_up_whatever_their_process_does() {
        for state in [VmState::Creating, VmState::Booting] {
            for p in [
                Process::NotRecorded,
                Process::Gone,
                Process::Answering,
                Process::Silent,
            ] {
                assert_eq!(row_action(state, p), RowAction::CleanUp, "{state:?} {p:?}");
            }
        }
    }

    #[test]
    fn settled_rows_are_kept_for_the_agent_to_read() {
        for state in [VmState::Failed, VmState::Exited] {
            assert_eq!(row_action(state, Process::Answering), RowAction::Keep);
            assert!(!needs_probe(state));
        }
        assert!(needs_probe(VmState::Running));
        assert!(!needs_probe(VmState::Booting));
    }

    #[test]
    fn suspended_rows_survive_a_restart_and_lose_only_a_leftover_vmm() {
        assert_eq!(
            row_action(VmState::Suspended, Process::NotRecorded),
            RowAction::Keep
        );
        assert_eq!(
            row_action(VmState::Suspended, Process::Gone),
            RowAction::Keep
        );
        for p in [Process::Answering, Process::Silent] {
            assert_eq!(
                row_action(VmState::Suspended, p),
                RowAction::KillKeepSuspended
            );
        }
        assert!(!needs_probe(VmState::Suspended));
    }

    #[test]
    fn interrupted_suspends_and_resumes_never_roll_a_run_vm_back() {
        assert_eq!(
            row_action(VmState::Suspending, Process::Answering),
            RowAction::ResumeRunning
        );
        assert_eq!(
            row_action(VmState::Suspending, Process::Gone),
            RowAction::MarkExited
        );
        assert_eq!(
            row_action(VmState::Resuming, Process::Answering),
            RowAction::Reattach
        );
        assert_eq!(
            row_action(VmState::Resuming, Process::Gone),
            RowAction::MarkExited
        );
        assert_eq!(
            row_action(VmState::Resuming, Process::NotRecorded),
            RowAction::BackToSuspended
        );
        for s in [VmState::Suspending, VmState::Resuming] {
            assert_eq!(row_action(s, Process::Silent), RowAction::KillAndFail);
            assert!(needs_probe(s));
        }
    }

    #[test]
    fn orphans_are_processes_no_kept_row_names_by_pid_and_start_time() {
        let found = vec![(10, 100, "a"), (11, 200, "b"), (10, 101, "c")];
        // pid 10 was recycled: only the one started at 100 is kept.
        let o = orphans(&found, &[(10, 100)]);
        assert_eq!(o, vec![(11, 200, "b"), (10, 101, "c")]);
        assert!(orphans(&found, &[(10, 100), (11, 200), (10, 101)]).is_empty());
    }

    #[test]
    fn stray_dirs_are_the_entries_without_a_row() {
        let entries = vec![PathBuf::from("/s/vms/a"), PathBuf::from("/s/vms/b")];
        assert_eq!(
            stray_dirs(&entries, &[Path::new("/s/vms/a")]),
            vec![PathBuf::from("/s/vms/b")]
        );
        assert!(stray_dirs(&entries, &[Path::new("/s/vms/a"), Path::new("/s/vms/b")]).is_empty());
    }
}
