//! NCCL buffer registration for the allocator's memory (feature `nccl`).
//!
//! NCCL moves data fastest between buffers registered with a communicator (`ncclCommRegister`):
//! it can then skip its internal copies and use zero-copy and user-buffer paths. PyTorch's NCCL hook
//! registers on segment allocation and free, and is switched off under expandable segments, whose
//! pages come and go. [`NcclRegistrar`] is a [`Registrar`]: attached to an allocator, it registers
//! each region the allocator maps — whole segments and **each mapped page of an expandable
//! segment** — and deregisters each with the handle NCCL gave for it, before the memory goes
//! (`alloc/registration.rs` has the lifetimes).
//!
//! The calls themselves are the CUDA backend's (`driver/cuda/nccl.rs`, the only place that names
//! cudarc's NCCL); the registrar's bookkeeping is generic over [`CommRegistration`], so its
//! lifetimes are tested without a GPU by a recording communicator, and on a GPU with NCCL by
//! `tests/nccl_gpu.rs` (run by `scripts/gpu-check.sh`).

use std::collections::HashMap;

pub use crate::driver::cuda::nccl::NcclComm;

use crate::alloc::{Region, Registrar, SegmentId};
use crate::error::Result;
use crate::sync::os::Mutex;

/// What a registrar needs of a communicator: register a range, deregister by handle.
pub trait CommRegistration: Send + Sync {
    /// Registers `len` bytes at `addr`; the handle that deregisters them.
    fn register(&self, addr: u64, len: u64) -> Result<u64>;
    /// Deregisters `handle`.
    fn deregister(&self, handle: u64) -> Result<()>;
}

impl CommRegistration for NcclComm {
    fn register(&self, addr: u64, len: u64) -> Result<u64> {
        NcclComm::register(self, addr, len)
    }

    fn deregister(&self, handle: u64) -> Result<()> {
        NcclComm::deregister(self, handle)
    }
}

/// Registers every region of an allocator with one communicator (see the module docs).
pub struct NcclRegistrar<C: CommRegistration = NcclComm> {
    comm: C,
    handles: Mutex<HashMap<SegmentId, u64>>,
}

impl<C: CommRegistration> std::fmt::Debug for NcclRegistrar<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclRegistrar")
            .field("registered", &self.handles.lock().len())
            .finish()
    }
}

impl<C: CommRegistration> NcclRegistrar<C> {
    /// A registrar over `comm` (attach it with
    /// [`attach_registrar`](crate::CachingAllocator::attach_registrar)).
    pub fn new(comm: C) -> Self {
        NcclRegistrar {
            comm,
            handles: Mutex::new(HashMap::new()),
        }
    }

    /// NCCL's handle for region `id`, while it is registered.
    pub fn handle(&self, id: SegmentId) -> Option<u64> {
        self.handles.lock().get(&id).copied()
    }

    /// Regions registered now.
    pub fn registered(&self) -> usize {
        self.handles.lock().len()
    }
}

impl<C: CommRegistration> Registrar for NcclRegistrar<C> {
    fn name(&self) -> &str {
        "nccl"
    }

    fn register(&self, region: &Region) -> Result<()> {
        let handle = self.comm.register(region.base.0, region.size)?;
        self.handles.lock().insert(region.id, handle);
        Ok(())
    }

    fn deregister(&self, region: &Region) {
        let handle = self.handles.lock().remove(&region.id);
        if let Some(handle) = handle {
            if let Err(err) = self.comm.deregister(handle) {
                tracing::error!(%err, region = %region.id, "NCCL deregistration failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The registrar's lifetimes with a recording communicator on the host backend.
    use super::*;
    use crate::alloc::OnRegistrationFailure;
    use crate::driver::HostDriver;
    use crate::error::{Error, ErrorKind};
    use crate::sync::os::atomic::{AtomicBool, AtomicU64, Ordering};
    use crate::sync::os::Arc;
    use crate::{AllocatorConfig, Runtime, Storage};

    /// Hands out handles and keeps what is registered; refuses on demand.
    #[derive(Default)]
    struct Recording {
        next: AtomicU64,
        live: Mutex<HashMap<u64, (u64, u64)>>,
        log: Mutex<Vec<String>>,
        refuse: AtomicBool,
    }

    impl CommRegistration for Arc<Recording> {
        fn register(&self, addr: u64, len: u64) -> Result<u64> {
            if self.refuse.load(Ordering::SeqCst) {
                return Err(Error::registration(
                    "nccl",
                    std::io::Error::other("ncclInvalidUsage (test)"),
                ));
            }
            let handle = 0x1000 + self.next.fetch_add(1, Ordering::SeqCst);
            self.live.lock().insert(handle, (addr, len));
            Ok(handle)
        }

        fn deregister(&self, handle: u64) -> Result<()> {
            if self.live.lock().remove(&handle).is_none() {
                self.log.lock().push(format!("unknown handle {handle:#x}"));
            }
            Ok(())
        }
    }

    fn runtime(conf: &str) -> Arc<Runtime> {
        let driver = HostDriver::builder()
            .devices(1)
            .memory_per_device(256 << 20)
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        Arc::new(
            Runtime::builder()
                .config(AllocatorConfig::parse(conf).unwrap_or_else(|e| panic!("{e}")))
                .check_invariants(true)
                .build(Arc::new(driver))
                .unwrap_or_else(|e| panic!("{e}")),
        )
    }

    #[test]
    fn each_expandable_page_is_registered_and_deregistered_by_its_handle() {
        let rt = runtime("expandable_segments:True");
        let comm = Arc::new(Recording::default());
        let registrar = Arc::new(NcclRegistrar::new(Arc::clone(&comm)));
        rt.attach_registrar(registrar.clone(), OnRegistrationFailure::FailAllocation)
            .unwrap_or_else(|e| panic!("{e}"));
        let a = Storage::new(&rt, 0, 5 << 20).unwrap_or_else(|e| panic!("{e}"));
        let b = Storage::new(&rt, 0, 1 << 20).unwrap_or_else(|e| panic!("{e}"));
        let pieces = a.registered_regions().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(pieces.len(), 3, "5 MiB over 2 MiB pages");
        for p in &pieces {
            let handle = registrar.handle(p.region.id);
            let live = handle.and_then(|h| comm.live.lock().get(&h).copied());
            assert_eq!(live, Some((p.region.base.0, p.region.size)));
        }
        assert_eq!(registrar.registered(), comm.live.lock().len());
        drop((a, b));
        rt.empty_cache();
        assert!(
            comm.live.lock().is_empty(),
            "every page deregistered by its handle"
        );
        assert!(comm.log.lock().is_empty(), "{:?}", comm.log.lock());
        assert_eq!(registrar.registered(), 0);
    }

    #[test]
    fn a_refused_registration_fails_the_allocation_or_is_skipped() {
        let rt = runtime("");
        let comm = Arc::new(Recording::default());
        comm.refuse.store(true, Ordering::SeqCst);
        let strict = Arc::new(NcclRegistrar::new(Arc::clone(&comm)));
        let id = rt
            .attach_registrar(strict, OnRegistrationFailure::FailAllocation)
            .unwrap_or_else(|e| panic!("{e}"));
        let err = Storage::new(&rt, 0, 1 << 20).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Registration);
        assert_eq!(rt.reserved_bytes(0).unwrap_or(1), 0);
        assert!(rt.detach_registrar(id));
        let lenient = Arc::new(NcclRegistrar::new(Arc::clone(&comm)));
        rt.attach_registrar(lenient.clone(), OnRegistrationFailure::CountAndSkip)
            .unwrap_or_else(|e| panic!("{e}"));
        let s = Storage::new(&rt, 0, 1 << 20).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(lenient.registered(), 0);
        assert_eq!(rt.registration_stats().registrars[0].failures, 1);
        drop(s);
    }
}
