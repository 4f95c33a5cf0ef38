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
//! cudarc's NCCL); the registrar's bookkeeping (`Handles`) is generic over a crate-private
//! communicator trait, so its lifetimes are tested without a GPU by a recording communicator, and
//! on a GPU with NCCL by `tests/nccl_gpu.rs` (run by `scripts/gpu-check.sh`). A storage that spans
//! pages of an expandable segment spans registrations: NCCL's user-buffer paths apply within one.

use std::collections::HashMap;

pub use crate::driver::cuda::nccl::{NcclComm, NcclExclusive, NCCL_MIN_VERSION};

use crate::alloc::{Region, Registrar, SegmentId};
use crate::error::{Error, Result};
use crate::sync::os::Mutex;

/// What the registrar needs of a communicator (crate-private: nothing outside can deregister a
/// handle the registrar holds).
pub(crate) trait CommRegistration: Send + Sync {
    fn register(&self, addr: u64, len: u64) -> Result<u64>;
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

/// The registrar's bookkeeping over any communicator: each region's handle, by its id.
pub(crate) struct Handles<C> {
    comm: C,
    by_region: Mutex<HashMap<SegmentId, u64>>,
}

impl<C: CommRegistration> Handles<C> {
    pub(crate) fn new(comm: C) -> Self {
        Handles {
            comm,
            by_region: Mutex::new(HashMap::new()),
        }
    }

    fn holds(&self, id: SegmentId) -> bool {
        self.by_region.lock().contains_key(&id)
    }

    fn registered(&self) -> usize {
        self.by_region.lock().len()
    }
}

impl<C: CommRegistration> Registrar for Handles<C> {
    fn name(&self) -> &str {
        "nccl"
    }

    fn register(&self, region: &Region) -> Result<()> {
        let handle = self
            .comm
            .register(region.base.0, region.size)
            .map_err(|e| Error::registration("nccl", e))?;
        self.by_region.lock().insert(region.id, handle);
        Ok(())
    }

    fn deregister(&self, region: &Region) {
        let handle = self.by_region.lock().remove(&region.id);
        if let Some(handle) = handle {
            if let Err(err) = self.comm.deregister(handle) {
                tracing::error!(%err, region = %region.id, "NCCL deregistration failed");
            }
        }
    }
}

/// Registers every region of an allocator with one communicator (see the module docs).
pub struct NcclRegistrar(Handles<NcclComm>);

impl std::fmt::Debug for NcclRegistrar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclRegistrar")
            .field("registered", &self.0.registered())
            .finish()
    }
}

impl NcclRegistrar {
    /// A registrar over `comm` (attach it with
    /// [`attach_registrar`](crate::Runtime::attach_registrar)).
    pub fn new(comm: NcclComm) -> Self {
        NcclRegistrar(Handles::new(comm))
    }

    /// The communicator, to hold [`NcclComm::exclusive`] around your own calls on it.
    pub fn comm(&self) -> &NcclComm {
        &self.0.comm
    }

    /// Whether region `id` is registered now.
    pub fn holds(&self, id: SegmentId) -> bool {
        self.0.holds(id)
    }

    /// Regions registered now.
    pub fn registered(&self) -> usize {
        self.0.registered()
    }
}

impl Registrar for NcclRegistrar {
    fn name(&self) -> &str {
        self.0.name()
    }

    fn register(&self, region: &Region) -> Result<()> {
        self.0.register(region)
    }

    fn deregister(&self, region: &Region) {
        self.0.deregister(region)
    }
}

#[cfg(test)]
mod tests {
    //! The registrar's lifetimes with a recording communicator on the host backend.
    use super::*;
    use crate::alloc::OnRegistrationFailure;
    use crate::driver::HostDriver;
    use crate::error::ErrorKind;
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
                // What `NcclComm` returns for a refusal: a driver error naming the call.
                return Err(Error::Driver {
                    backend: "cuda",
                    call: "ncclCommRegister",
                    message: "NCCL said ncclInvalidUsage (test)".into(),
                    source: None,
                });
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
        let registrar = Arc::new(Handles::new(Arc::clone(&comm)));
        rt.attach_registrar(registrar.clone(), OnRegistrationFailure::FailAllocation)
            .unwrap_or_else(|e| panic!("{e}"));
        let a = Storage::new(&rt, 0, 5 << 20).unwrap_or_else(|e| panic!("{e}"));
        let b = Storage::new(&rt, 0, 1 << 20).unwrap_or_else(|e| panic!("{e}"));
        let pieces = a.registered_regions().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(pieces.len(), 3, "5 MiB over 2 MiB pages");
        for p in &pieces {
            let handle = registrar.by_region.lock().get(&p.region.id).copied();
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
        let strict = Arc::new(Handles::new(Arc::clone(&comm)));
        let id = rt
            .attach_registrar(strict, OnRegistrationFailure::FailAllocation)
            .unwrap_or_else(|e| panic!("{e}"));
        let err = Storage::new(&rt, 0, 1 << 20).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Registration);
        assert_eq!(rt.memory_reserved(0).unwrap_or(1), 0);
        assert!(rt.detach_registrar(id));
        let lenient = Arc::new(Handles::new(Arc::clone(&comm)));
        rt.attach_registrar(lenient.clone(), OnRegistrationFailure::CountAndSkip)
            .unwrap_or_else(|e| panic!("{e}"));
        let s = Storage::new(&rt, 0, 1 << 20).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(lenient.registered(), 0);
        assert_eq!(rt.registration_stats().registrars[0].failures, 1);
        drop(s);
    }
}
