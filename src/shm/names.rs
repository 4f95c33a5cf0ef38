//! The names of this process's shared-memory objects: which ones it must unlink at exit, the
//! *liveness file* that tells other processes it is alive, and the sweep that removes what dead
//! processes left behind.
//!
//! Every object name starts with `cudalloc-<creator pid>-`. A process that creates its first object
//! also creates `cudalloc-<pid>-<nonce>-live0` and holds an exclusive OFD lock on it for its whole
//! life; Linux drops that lock when the process dies (SIGKILL included). The sweep decides per
//! creator pid:
//!
//! | creator                                               | its objects                        |
//! |-------------------------------------------------------|------------------------------------|
//! | this process                                          | kept                               |
//! | a locked liveness file, or `kill(pid, 0)` finds it     | kept (alive)                       |
//! | dead, and some ref-counter file of it is locked        | kept: a consumer still holds a lease |
//! | dead, nothing locked                                   | unlinked (mappings stay valid)     |
//!
//! The lock makes liveness hold across pid namespaces (a container sharing `/dev/shm` whose pids
//! we cannot see); the pid probe covers a process between creating and locking its liveness file.
//! Unlinking only removes names: a consumer that has a dead producer's segment mapped keeps using it.

use std::collections::{BTreeMap, HashSet};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};

use nix::fcntl::FcntlArg;

use super::{path_of, NAME_PREFIX, SHM_DIR};
use crate::error::{Error, Result};
use crate::process::PerProcess;
use crate::sync::os::Mutex;

/// What this process created and has not unlinked yet, and its liveness file.
struct LiveNames {
    /// The process these names belong to (a forked child inherits the set but not the objects).
    creator: u32,
    names: HashSet<String>,
    /// The liveness file, exclusively locked for the life of the process.
    _liveness: Option<File>,
}

/// Names this process created and has not unlinked yet, with the pid of the process that created
/// them. At normal process exit (`atexit`) every remaining name is unlinked, so nothing outlives the
/// process in `/dev/shm` even when memory had to stay allocated to the end (an allocator dropped
/// while consumers still held its storages). Mappings stay valid for other processes: only the
/// names go.
///
/// Only the creating process unlinks: a forked child inherits this set (and the `atexit` hook) but
/// not the objects' ownership, so when it exits — or drops a copied `SharedMemory` — the parent's
/// names stay. A child that creates objects of its own starts a set of its own.
static LIVE_NAMES: PerProcess<Mutex<Option<LiveNames>>> = PerProcess::new(|| Mutex::new(None));

extern "C" fn unlink_live_names_at_exit() {
    if let Some(live) = LIVE_NAMES.lock().take() {
        if live.creator != std::process::id() {
            return;
        }
        for name in live.names {
            // At exit, with nowhere to report: one already gone is fine, one left is swept.
            let _ = std::fs::remove_file(path_of(&name));
        }
    }
}

/// Tag of liveness files (`cudalloc-<pid>-<nonce>-live0`).
const LIVENESS_TAG: &str = "live";

/// Prefix of a liveness file being made (`cudalloc-making-<nonce>`): locked under this name, then
/// renamed, so a liveness file is never seen unlocked by a sweep. No pid follows the prefix, so no
/// sweep groups it with a process; a sweep removes one that nobody locks (its maker died).
const MAKING_PREFIX: &str = "cudalloc-making-";

/// Creates this process's liveness file, locked before it appears under its name.
fn liveness_file(pid: u32) -> Result<(String, File)> {
    let mut last = None;
    for _ in 0..3 {
        let making = format!("{MAKING_PREFIX}{:016x}", super::random_u64());
        let file = super::create_exclusive(&making)
            .map_err(|e| Error::host_os("creating the liveness file", format!("{making}: {e}")))?;
        if let Err(err) = ofd_lock(&file, libc::F_WRLCK, libc::F_OFD_SETLK, 0, 0) {
            // Best effort: the lock's error is the one reported; an unlocked leftover is swept.
            let _ = std::fs::remove_file(path_of(&making));
            return Err(err);
        }
        let name = super::object_name(pid, super::random_u64(), LIVENESS_TAG, 0);
        match std::fs::rename(path_of(&making), path_of(&name)) {
            Ok(()) => return Ok((name, file)),
            // A sweep took the file for a dead maker's between the lock and the rename: again.
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => last = Some(err),
            Err(err) => {
                // Best effort, as above.
                let _ = std::fs::remove_file(path_of(&making));
                return Err(Error::host_os("renaming the liveness file", err));
            }
        }
    }
    Err(Error::host_os(
        "renaming the liveness file",
        last.map_or_else(|| "no attempt".to_owned(), |e| e.to_string()),
    ))
}

/// Makes sure this process has its locked liveness file *before* it creates an object: a sweep in
/// any pid namespace then sees the process alive by the lock alone (a pid proves nothing across
/// namespaces). An object cannot be created without one.
pub(super) fn ensure_liveness() -> Result<()> {
    let me = std::process::id();
    let mut live = LIVE_NAMES.lock();
    if live.as_ref().is_some_and(|l| l.creator == me) {
        return Ok(());
    }
    if live.is_none() {
        // SAFETY: registers a plain `extern "C"` function with no arguments; it only touches a
        // static mutex and the file system, which are valid at exit.
        unsafe { libc::atexit(unlink_live_names_at_exit) };
    }
    let (name, file) = liveness_file(me)?;
    let mut names = HashSet::new();
    names.insert(name);
    *live = Some(LiveNames {
        creator: me,
        names,
        _liveness: Some(file),
    });
    Ok(())
}

/// Notes `name`, just created by this process (after [`ensure_liveness`]), for the exit hook.
pub(super) fn remember_name(name: &str) {
    let me = std::process::id();
    match LIVE_NAMES.lock().as_mut() {
        Some(l) if l.creator == me => {
            l.names.insert(name.to_owned());
        }
        _ => tracing::warn!(
            name,
            "an object created without this process's liveness file"
        ),
    }
}

pub(super) fn forget_name(name: &str) {
    if let Some(live) = LIVE_NAMES.lock().as_mut() {
        live.names.remove(name);
    }
}

/// `fcntl(F_OFD_*)` of `lock_type` over bytes `start..start + len` of `file` (`len` 0: to the end
/// of the file). OFD locks belong to the open file description: they are dropped when its last
/// descriptor closes — when the process dies, SIGKILL included.
pub(crate) fn ofd_lock(
    file: &File,
    lock_type: libc::c_int,
    cmd: libc::c_int,
    start: u64,
    len: u64,
) -> Result<libc::flock> {
    let (Ok(start), Ok(len)) = (libc::off_t::try_from(start), libc::off_t::try_from(len)) else {
        return Err(Error::invalid("lock range exceeds the file offset type"));
    };
    let mut fl = libc::flock {
        l_type: lock_type as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: start,
        l_len: len,
        l_pid: 0,
    };
    let arg = match cmd {
        libc::F_OFD_SETLK => FcntlArg::F_OFD_SETLK(&fl),
        libc::F_OFD_SETLKW => FcntlArg::F_OFD_SETLKW(&fl),
        libc::F_OFD_GETLK => FcntlArg::F_OFD_GETLK(&mut fl),
        _ => {
            return Err(Error::invalid(format!(
                "{cmd} is not an F_OFD_* lock command"
            )))
        }
    };
    nix::fcntl::fcntl(file, arg)
        .map_err(|e| Error::host_os("fcntl(F_OFD_*)", std::io::Error::from(e)))?;
    Ok(fl)
}

/// Whether any process holds a lock on any byte of the object `name` (false if it is gone).
fn is_locked(name: &str) -> bool {
    let Ok(file) = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path_of(name))
    else {
        return false;
    };
    ofd_lock(&file, libc::F_WRLCK, libc::F_OFD_GETLK, 0, 0)
        .is_ok_and(|fl| fl.l_type != libc::F_UNLCK as libc::c_short)
}

/// Whether a process with this pid exists (signal 0 probes without sending anything).
pub(crate) fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    let Some(pid) = rustix::process::Pid::from_raw(pid) else {
        // Pid 0 names no process (to `kill` it means our own group): nothing is judged dead by it.
        return true;
    };
    // Signal 0 only checks existence and permission; EPERM: it exists, as someone else's.
    matches!(
        rustix::process::test_kill_process(pid),
        Ok(()) | Err(rustix::io::Errno::PERM)
    )
}

/// The tag of ref-counter file names (`cudalloc-<pid>-<nonce>-ref<n>`).
pub(crate) const REF_FILE_TAG: &str = "-ref";

/// The creator pid in an object name (`cudalloc-<pid>-…`).
fn creator_of(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(NAME_PREFIX)?;
    let digits = rest.split('-').next()?;
    digits.parse().ok()
}

/// Removes the shared-memory objects of dead cudalloc processes that no consumer holds a lease on,
/// and returns their names. A process is alive while its liveness file is locked: every process
/// locks one before its first object, so the lock decides in every pid namespace sharing this
/// `/dev/shm` (a pid seen from another namespace proves nothing: it may name another process or
/// none). A pid is consulted only for objects with no liveness file of their pid (none made by
/// this version); processes of other namespaces sharing a pid are judged together (any of them
/// alive keeps them all: only ever keeping more). Objects of live processes and of dead producers whose storages a consumer still holds
/// are never touched; unlinking only
/// removes names, so mappings stay valid. Run by every new [`Runtime`](crate::Runtime),
/// by `ipc_collect()` and by `cudalloc clean`.
pub fn sweep_orphans() -> Result<Vec<String>> {
    let euid = rustix::process::geteuid().as_raw();
    let me = std::process::id();
    let mut by_creator: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    let dir = std::fs::read_dir(SHM_DIR).map_err(|e| Error::host_os("readdir", e))?;
    let mut removed = Vec::new();
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(MAKING_PREFIX)
            && entry
                .metadata()
                .is_ok_and(|m| m.is_file() && m.uid() == euid)
            && !is_locked(&name)
        {
            // A liveness file whose maker died before naming it.
            if std::fs::remove_file(path_of(&name)).is_ok() {
                removed.push(name);
            }
            continue;
        }
        let Some(pid) = creator_of(&name) else {
            continue;
        };
        let ours = entry.metadata().is_ok_and(|m| {
            (m.file_type().is_file() || m.file_type().is_socket()) && m.uid() == euid
        });
        if pid != me && ours && super::validate_name(&name).is_ok() {
            by_creator.entry(pid).or_default().push(name);
        }
    }
    for (pid, names) in by_creator {
        // Every process locks a liveness file before its first object, so where liveness files
        // exist their locks alone decide. A pid is consulted only for objects without one (never
        // made by this version): in another pid namespace it names another process or none —
        // pid 1, the creator of every first process of a container, is alive everywhere, and
        // trusting it kept a dead container process's objects for ever.
        let liveness: Vec<&String> = names
            .iter()
            .filter(|n| n.contains(&format!("-{LIVENESS_TAG}")))
            .collect();
        let alive = if liveness.is_empty() {
            process_alive(pid)
        } else {
            liveness.iter().any(|n| is_locked(n))
        };
        if alive {
            continue;
        }
        if let Some(leased) = names
            .iter()
            .find(|n| n.contains(REF_FILE_TAG) && is_locked(n))
        {
            tracing::debug!(pid, file = %leased, "dead process's objects kept: a consumer holds a lease");
            continue;
        }
        for name in names {
            match std::fs::remove_file(path_of(&name)) {
                Ok(()) => removed.push(name),
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => tracing::warn!(%err, "cannot remove orphan {name}"),
            }
        }
    }
    if !removed.is_empty() {
        tracing::warn!(
            objects = removed.len(),
            "removed shared-memory objects left by dead cudalloc processes"
        );
    }
    Ok(removed)
}
