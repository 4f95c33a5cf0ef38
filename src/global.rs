//! `GLOBAL`: the process-wide allocator a tensor library uses, built lazily from the environment
//! (`CUDALLOC_BACKEND`, `CUDALLOC_CONF`, and the host backend's `CUDALLOC_HOST_*`) on first use.
//!
//! If the environment is invalid, every call returns the same configuration error (built once,
//! never a panic). The choice of backend is logged through `tracing`.

use crate::alloc::{DataPtr, DeviceStats, Snapshot};
use crate::config::AllocatorConfig;
use crate::driver::{BackendChoice, StreamId};
use crate::error::Result;
use crate::runtime::Runtime;
use crate::storage::Storage;
use crate::sync::os::{Arc, OnceLock};

/// The process-wide allocator (see the [module docs](self)).
pub static GLOBAL: Global = Global {
    cell: OnceLock::new(),
};

/// The type of [`GLOBAL`].
#[derive(Debug)]
pub struct Global {
    cell: OnceLock<Result<Arc<Runtime>>>,
}

impl Global {
    /// The runtime, building it from the environment on first use.
    pub fn get(&self) -> Result<&Arc<Runtime>> {
        self.cell
            .get_or_init(|| {
                let backend = BackendChoice::from_env()?.open()?;
                let config = AllocatorConfig::from_env()?;
                tracing::info!(backend = %backend.driver.backend(), ?config, "cudalloc GLOBAL allocator ready");
                Ok(Arc::new(Runtime::new(backend.driver, config)?))
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Allocates on `device`'s current stream.
    pub fn allocate(&self, device: usize, size: u64) -> Result<DataPtr> {
        self.get()?.allocate(device, size)
    }

    /// A new storage of `nbytes` on `device`.
    pub fn storage(&self, device: usize, nbytes: u64) -> Result<Storage> {
        Storage::new(self.get()?, device, nbytes)
    }

    /// See [`CachingAllocator::empty_cache`].
    pub fn empty_cache(&self) -> Result<()> {
        self.get()?.empty_cache();
        Ok(())
    }

    /// See [`CachingAllocator::memory_stats`].
    pub fn memory_stats(&self, device: usize) -> Result<DeviceStats> {
        self.get()?.memory_stats(device)
    }

    /// See [`CachingAllocator::memory_summary`].
    pub fn memory_summary(&self, device: usize) -> Result<String> {
        self.get()?.memory_summary(device)
    }

    /// See [`CachingAllocator::snapshot`].
    pub fn snapshot(&self) -> Result<Snapshot> {
        Ok(self.get()?.snapshot())
    }

    /// See [`CachingAllocator::ipc_collect`].
    pub fn ipc_collect(&self) -> Result<bool> {
        Ok(self.get()?.ipc_collect())
    }

    /// See [`CachingAllocator::create_stream`].
    pub fn create_stream(&self, device: usize) -> Result<StreamId> {
        self.get()?.create_stream(device)
    }

    /// See [`CachingAllocator::record_stream`].
    pub fn record_stream(&self, data: &DataPtr, stream: StreamId) -> Result<()> {
        self.get()?.record_stream(data, stream)
    }

    /// See [`CachingAllocator::set_per_process_memory_fraction`].
    pub fn set_per_process_memory_fraction(&self, fraction: f64, device: usize) -> Result<()> {
        self.get()?
            .set_per_process_memory_fraction(fraction, device)
    }
}
