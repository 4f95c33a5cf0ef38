//! # cudalloc
//!
//! A CUDA caching allocator with cross-process IPC sharing and copy-on-write lazy clones, meant to
//! be the global GPU allocator of a Rust tensor library. Everything runs and is tested without a GPU
//! on a real host backend ([`HostDriver`]); the CUDA backend ([`CudaDriver`]) is loaded at run time.
//!
//! Layers, bottom up: [`driver`] (the [`Driver`] trait and its two backends) → [`alloc`] (the
//! caching allocator, sharded per stream) → [`DataPtr`] / [`Storage`] → [`GLOBAL`].

pub mod alloc;
pub mod config;
pub mod cow;
pub mod driver;
mod error;
mod global;
pub mod ipc;
mod shm;
mod storage;
mod sync;

pub use alloc::{CachingAllocator, CachingAllocatorBuilder, DeviceStats, Snapshot, StreamGuard};
pub use config::AllocatorConfig;
pub use driver::{
    Backend, BackendChoice, CudaDriver, DevicePtr, Driver, EventFlags, EventId, HostDriver,
    HostDriverBuilder, IpcEventHandle, IpcMemHandle, MemInfo, OpenedSegment, SelectedBackend,
    StreamId,
};
pub use error::{Error, ErrorKind, Result};
pub use global::{Global, GLOBAL};
pub use ipc::IpcHandle;
pub use shm::sweep_orphans;
pub use storage::{DataPtr, Storage};
