//! IPC bookkeeping that CUDA keeps per *process*, shared by every `CudaDriver` of the process.
//!
//! CUDA's IPC rules are about processes, not about our driver objects: a memory handle cannot be
//! opened in the process that exported it, and a process maps a handle once per device (older
//! drivers refuse a second open, newer ones count it). Two allocators with their own drivers in
//! one process are one process to CUDA, so the tables live here, in a process-wide static:
//!
//! | table      | key                        | value                   | updated by                       |
//! |------------|----------------------------|-------------------------|----------------------------------|
//! | `exported` | handle bytes               | —                       | export (insert), free (remove)   |
//! | `opened`   | (device, handle bytes)     | pointer, size, users    | open (+1, maps on the first), close (−1, unmaps at 0) |
//!
//! A handle this process exported is refused before it reaches CUDA (with a typed error, where
//! CUDA's own answer would be an opaque `CUDA_ERROR_INVALID_CONTEXT`). Opening and closing hold the
//! table's lock across the CUDA call, so two drivers never map the same handle twice. Found by the
//! contract double (`tools/cuda-double`), which records both as violations.

use std::collections::{HashMap, HashSet};

use crate::driver::IPC_HANDLE_SIZE;
use crate::error::{Error, Result};
use crate::process::PerProcess;
use crate::sync::os::Mutex;

type HandleBytes = [u8; IPC_HANDLE_SIZE];

#[derive(Debug, Clone, Copy)]
struct Mapping {
    ptr: u64,
    size: u64,
    users: usize,
}

#[derive(Debug, Default)]
struct Tables {
    exported: HashSet<HandleBytes>,
    opened: HashMap<(usize, HandleBytes), Mapping>,
}

static TABLES: PerProcess<Mutex<Option<Tables>>> = PerProcess::new(|| Mutex::new(None));

fn with<R>(f: impl FnOnce(&mut Tables) -> R) -> R {
    let mut guard = TABLES.lock();
    f(guard.get_or_insert_with(Tables::default))
}

/// Notes that this process exported `handle`.
pub(super) fn exported(handle: HandleBytes) {
    with(|t| t.exported.insert(handle));
}

/// Forgets an exported handle (its segment is being freed).
pub(super) fn unexported(handle: &HandleBytes) {
    with(|t| t.exported.remove(handle));
}

/// The process's mapping of `handle` on `device`: the existing one (one more user), or a new one
/// from `map` (called with the table locked). A handle this process exported is refused.
pub(super) fn open(
    device: usize,
    handle: &HandleBytes,
    map: impl FnOnce() -> Result<(u64, u64)>,
) -> Result<(u64, u64)> {
    with(|t| {
        if t.exported.contains(handle) {
            return Err(Error::invalid(
                "this IPC memory handle was exported by this process: CUDA cannot open it here; \
                 use the original storage",
            ));
        }
        if let Some(m) = t.opened.get_mut(&(device, *handle)) {
            m.users += 1;
            return Ok((m.ptr, m.size));
        }
        let (ptr, size) = map()?;
        t.opened.insert(
            (device, *handle),
            Mapping {
                ptr,
                size,
                users: 1,
            },
        );
        Ok((ptr, size))
    })
}

/// Gives up one user of the mapping of `handle` on `device`; the last one calls `unmap` (with the
/// table locked).
pub(super) fn close(
    device: usize,
    handle: &HandleBytes,
    unmap: impl FnOnce() -> Result<()>,
) -> Result<()> {
    with(|t| {
        let key = (device, *handle);
        let Some(m) = t.opened.get_mut(&key) else {
            return Err(Error::invalid(
                "closing an IPC mapping this process does not hold",
            ));
        };
        m.users -= 1;
        if m.users > 0 {
            return Ok(());
        }
        t.opened.remove(&key);
        unmap()
    })
}
