#![doc = include_str!("../README.md")]
//!
//! ## Layers of the crate
//!
//! Everything runs and is tested without a GPU on a real host backend ([`HostDriver`]); the CUDA
//! backend ([`CudaDriver`]) is loaded at run time. Layers, bottom up (a module never imports a layer above it; `tests/layering.rs` checks it):
//!
//! ```text
//! cli        the `cudalloc` command (src/main.rs, src/cli/)
//! global     GLOBAL: the process-wide runtime
//! storage    Storage: the unit of aliasing; its state table; which Storage a receipt returns
//! runtime    Runtime: a CachingAllocator and the IPC state side by side (ipc_collect, drains)
//! replay     traces replayed through a CachingAllocator on the simulated device (feature `replay`)
//! cow | ipc  copy-on-write contexts | sharing across processes — both on DataPtrs
//! alloc      CachingAllocator, DataPtr and its owners (upper layers attach trait objects)
//! driver     the Driver trait: HostDriver, CudaDriver, SimDriver
//! ground     error, sync, process, config, shm, codec
//! ```

pub mod alloc;
mod codec;
pub mod config;
pub mod cow;
pub mod driver;
pub mod error;
pub mod global;
pub mod ipc;
mod process;
#[cfg(feature = "replay")]
pub mod replay;
pub mod runtime;
mod shm;
pub mod storage;
mod sync;

pub use alloc::{
    CachingAllocator, CachingAllocatorBuilder, DataPtr, DeviceStats, Sanitize, Snapshot,
    StreamGuard,
};
pub use config::AllocatorConfig;
pub use driver::{
    Backend, BackendChoice, ChunkId, CudaDriver, DeviceAddr, Driver, EventFlags, EventId,
    ExportedChunk, HostDriver, HostDriverBuilder, IpcEventHandle, IpcMemHandle, MemInfo,
    OpenedSegment, SanitizeOptions, SanitizedDriver, Sanitizer, SelectedBackend, SimDriver,
    StreamId,
};
pub use error::{Error, ErrorKind, ForeignEventFailure, Result};
pub use global::{Global, GLOBAL};
pub use ipc::IpcHandle;
pub use runtime::{Runtime, RuntimeBuilder};
pub use shm::sweep_orphans;
#[cfg(feature = "cudarc")]
pub use storage::views::{self, StorageView, StorageViewMut};
pub use storage::Storage;

/// The cudarc this crate is built with (feature `cudarc`): use it for your own launches, so the
/// views' traits are the ones your cudarc implements.
#[cfg(feature = "cudarc")]
pub use cudarc;
