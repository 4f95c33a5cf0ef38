//! NCCL buffer registration through cudarc (feature `nccl`): `ncclCommRegister` /
//! `ncclCommDeregister` on a communicator the caller owns. NCCL is loaded at run time like the
//! driver: [`NcclComm::new`] checks that the library is present before any call reaches it (a
//! missing symbol would otherwise panic inside cudarc), so every other call here is reachable only
//! with NCCL loaded. The registrar that drives these calls for the allocator is `crate::nccl`.

use cudarc::nccl::sys;

use crate::error::{Error, Result};

/// A communicator registrations are made on (not owned: the caller keeps it alive, and destroys
/// it only after every registration made through this value was deregistered).
#[derive(Debug)]
pub struct NcclComm {
    comm: sys::ncclComm_t,
}

// SAFETY: an NCCL communicator may be used from any thread; registration calls on one
// communicator are serialized by the allocator's registry (one registrar, one lock).
unsafe impl Send for NcclComm {}
// SAFETY: as above: `&NcclComm` only reaches `ncclCommRegister`/`ncclCommDeregister`, which the
// registry calls one at a time.
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
    /// Wraps a communicator for registrations, once NCCL's library is known to be loaded.
    ///
    /// # Safety
    /// `comm` is a live communicator (from `ncclCommInitRank` or the like) that outlives this
    /// value and every registration made through it.
    pub unsafe fn new(comm: sys::ncclComm_t) -> Result<Self> {
        // SAFETY: only asks the loader whether libnccl can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::NoCudaDriver(
                "NCCL's library (libnccl.so.2) is not present".into(),
            ));
        }
        if comm.is_null() {
            return Err(Error::invalid("a null NCCL communicator"));
        }
        Ok(NcclComm { comm })
    }

    /// Registers `len` bytes of device memory at `addr`; the handle NCCL gave back.
    pub fn register(&self, addr: u64, len: u64) -> Result<u64> {
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
    pub fn deregister(&self, handle: u64) -> Result<()> {
        // SAFETY: `handle` came from `ncclCommRegister` on this live communicator and is
        // deregistered once (the registrar forgets it here).
        let status = unsafe { sys::ncclCommDeregister(self.comm, handle as *mut std::ffi::c_void) };
        status
            .result()
            .map(drop)
            .map_err(|e| nccl_error("ncclCommDeregister", e))
    }
}
