//! NCCL buffer registration through cudarc (feature `nccl`): `ncclCommRegister` /
//! `ncclCommDeregister` on a communicator the caller owns. NCCL is loaded at run time like the
//! driver: [`NcclComm::new`] checks that the library is present before any call reaches it (a
//! missing symbol would otherwise panic inside cudarc), so every other call here is reachable only
//! with NCCL loaded. The registrar that drives these calls for the allocator is `crate::nccl`.

use cudarc::nccl::sys;

use crate::error::{Error, Result};
use crate::sync::os::{Mutex, MutexGuard};

/// The communicator held for the caller's own calls ([`NcclComm::exclusive`]).
#[derive(Debug)]
pub struct NcclExclusive<'a>(#[allow(dead_code)] MutexGuard<'a, ()>);

/// The first NCCL with `ncclCommRegister` / `ncclCommDeregister` (2.19.0, as `ncclGetVersion`
/// encodes it).
pub const NCCL_MIN_VERSION: i32 = 21_900;

/// A communicator registrations are made on (not owned: the caller keeps it alive, and destroys
/// it only after every registration made through this value was deregistered). Its calls are
/// serialized by its own lock, which the caller also holds around its own use of the
/// communicator from other threads ([`NcclComm::exclusive`]): NCCL communicators are not
/// thread-safe.
#[derive(Debug)]
pub struct NcclComm {
    comm: sys::ncclComm_t,
    lock: Mutex<()>,
}

// SAFETY: the communicator is only reached through `register`/`deregister`, which hold `lock`;
// the constructor's contract makes every other use of it hold the same lock (`exclusive`).
unsafe impl Send for NcclComm {}
// SAFETY: as above: every call on the communicator through `&NcclComm` holds `lock`.
unsafe impl Sync for NcclComm {}

fn nccl_error(call: &'static str, err: impl std::fmt::Debug) -> Error {
    Error::Driver {
        backend: "cuda",
        call,
        message: format!("NCCL said {err:?}"),
        source: None,
    }
}

impl NcclComm {
    /// Wraps a communicator for registrations, once NCCL's library is known to be loaded and to
    /// have the registration calls (2.19 or later).
    ///
    /// # Safety
    /// `comm` is a live communicator (from `ncclCommInitRank` or the like) that outlives this
    /// value and every registration made through it, and that no other thread uses while not
    /// holding [`NcclComm::exclusive`] (the allocator registers from whichever thread maps).
    pub unsafe fn new(comm: sys::ncclComm_t) -> Result<Self> {
        // SAFETY: only asks the loader whether libnccl can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::NoCudaDriver(
                "NCCL's library (libnccl.so.2) is not present".into(),
            ));
        }
        // ncclGetVersion is in every NCCL; the registration calls only from 2.19 on (cudarc would
        // panic on the missing symbol).
        let version = cudarc::nccl::result::get_nccl_version()
            .map_err(|e| nccl_error("ncclGetVersion", e))?;
        if version < NCCL_MIN_VERSION {
            return Err(Error::NoCudaDriver(format!(
                "NCCL {version} has no buffer registration (ncclCommRegister needs 2.19, {NCCL_MIN_VERSION})"
            )));
        }
        if comm.is_null() {
            return Err(Error::invalid("a null NCCL communicator"));
        }
        Ok(NcclComm {
            comm,
            lock: Mutex::new(()),
        })
    }

    /// Hold this around your own calls on the communicator from any thread: the allocator's
    /// registrations (from whichever thread maps memory) wait meanwhile.
    pub fn exclusive(&self) -> NcclExclusive<'_> {
        NcclExclusive(self.lock.lock())
    }

    /// Registers `len` bytes of device memory at `addr`; the handle NCCL gave back.
    pub(crate) fn register(&self, addr: u64, len: u64) -> Result<u64> {
        let _one_at_a_time = self.lock.lock();
        let len = usize::try_from(len).map_err(|_| Error::invalid("a region past usize"))?;
        let mut handle: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: the communicator is live (constructor contract) and NCCL is loaded; `addr` is
        // device memory the allocator mapped and keeps mapped until it deregisters; `handle` is a
        // valid out-pointer.
        let status = unsafe {
            sys::ncclCommRegister(self.comm, addr as *mut std::ffi::c_void, len, &mut handle)
        };
        status
            .result()
            .map_err(|e| nccl_error("ncclCommRegister", e))?;
        Ok(handle as u64)
    }

    /// Deregisters what [`register`](Self::register) returned `handle` for.
    pub(crate) fn deregister(&self, handle: u64) -> Result<()> {
        let _one_at_a_time = self.lock.lock();
        // SAFETY: `handle` came from `ncclCommRegister` on this live communicator and is
        // deregistered once (the registrar forgets it here).
        let status = unsafe { sys::ncclCommDeregister(self.comm, handle as *mut std::ffi::c_void) };
        status
            .result()
            .map(drop)
            .map_err(|e| nccl_error("ncclCommDeregister", e))
    }
}
