//! cubecl's memory management (the allocator of Burn) as a benchmark peer: its
//! `MemoryManagement` with the default `SubSlices` configuration over a storage that hands out
//! address ranges (like ours, the benchmarks never touch memory). Only with `--features bench-peers`.
//!
//! Differences to keep in mind when reading the numbers: cubecl's manager is single-threaded
//! (`&mut self`, no lock), has no streams, no cross-stream frees, no stats, and frees a slice by
//! dropping its handle (reference counted).

use std::collections::HashMap;
use std::sync::Arc;

use cubecl_ir::MemoryDeviceProperties;
use cubecl_runtime::logging::ServerLogger;
use cubecl_runtime::memory_management::{
    MemoryConfiguration, MemoryManagement, MemoryManagementOptions, SliceHandle,
};
use cubecl_runtime::server::IoError;
use cubecl_runtime::storage::{ComputeStorage, StorageHandle, StorageId, StorageUtilization};

/// Address ranges with no memory behind them.
#[derive(Default)]
pub struct AddressStorage {
    live: HashMap<StorageId, u64>,
}

impl ComputeStorage for AddressStorage {
    type Resource = u64;

    fn alignment(&self) -> usize {
        512
    }

    fn get(&mut self, handle: &StorageHandle) -> u64 {
        handle.utilization.offset
    }

    fn alloc(&mut self, size: u64) -> Result<StorageHandle, IoError> {
        let id = StorageId::new();
        self.live.insert(id, size);
        Ok(StorageHandle {
            id,
            utilization: StorageUtilization { offset: 0, size },
        })
    }

    fn dealloc(&mut self, id: StorageId) {
        self.live.remove(&id);
    }
}

/// cubecl's manager over [`AddressStorage`], pages up to 1 GiB, 512-byte alignment.
pub fn manager() -> MemoryManagement<AddressStorage> {
    let props = MemoryDeviceProperties {
        max_page_size: 1 << 30,
        alignment: 512,
    };
    MemoryManagement::from_configuration(
        AddressStorage::default(),
        &props,
        MemoryConfiguration::SubSlices,
        Arc::new(ServerLogger::default()),
        MemoryManagementOptions::new("cudalloc-bench-peer"),
    )
}

/// One reservation.
pub fn reserve(m: &mut MemoryManagement<AddressStorage>, size: u64) -> SliceHandle {
    m.reserve(size).unwrap()
}
