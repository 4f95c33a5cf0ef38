#![doc = include_str!("../README.md")]
// Feature badges on docs.rs (nightly rustdoc with `--cfg docsrs`; see `[package.metadata.docs.rs]`).
#![cfg_attr(docsrs, feature(doc_cfg))]
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
//! runtime    Runtime: the caching allocator and the IPC state side by side, answering for both
//! replay     traces replayed through a CachingAllocator on the simulated device (feature `replay`)
//! cow | ipc  copy-on-write contexts | sharing across processes — both on DataPtrs
//! alloc      CachingAllocator, DataPtr and its owners (upper layers attach trait objects)
//! driver     the Driver trait: HostDriver, CudaDriver, SimDriver
//! ground     error, sync, process, config, shm, codec
//! ```

mod alloc;
mod codec;
mod config;
mod cow;
mod driver;
mod error;
mod global;
mod ipc;
#[cfg(feature = "nccl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
pub mod nccl;
#[cfg(feature = "nixl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nixl")))]
pub mod nixl;
mod pinned;
mod process;
#[cfg(feature = "replay")]
#[cfg_attr(docsrs, doc(cfg(feature = "replay")))]
pub mod replay;
mod runtime;
mod shm;
mod storage;
mod sync;

// One door (see "The public surface" in the crate docs): a library talks to `GLOBAL` and the
// `Runtime` it hands out; embedders with a driver of their own build a `Runtime` over it. Every
// public item has one path; `docs/public-api.txt` lists them (`tests/public_api.rs`).
pub use alloc::{
    format_size, trace_json_lines, Capture, CaptureRoute, DataPtr, DeviceStats, Frame,
    FreeMemoryCallback, Graph, GraphPool, HistoryMode, HistoryOptions, MemPool, MemPoolId,
    MemPoolOptions, OnRegistrationFailure, OutOfMemoryEvent, OutOfMemoryObserver, PoolScope,
    PoolStats, Region, RegionKind, RegisteredRegion, Registrar, RegistrarId, RegistrarStats,
    RegistrationStats, Sanitize, SegmentChange, SegmentEvent, SegmentId, SegmentObserver, Snapshot,
    SnapshotBlock, SnapshotBlockState, SnapshotSegment, Stat, StreamGuard, TraceAction, TraceEntry,
};
pub use config::{AllocatorConfig, DefaultStream, StreamOrder};
pub use driver::capability;
pub use driver::cuda::driver_library_present;
pub use driver::host::{parse_byte_size, HostKernelMemory, HostRange};
pub use driver::pattern;
pub use driver::sanitizer::{AccessKind, AccessReport, HazardKind, HazardReport, Touch};
pub use driver::sim::MAX_SIM_DEVICES;
pub use driver::{
    Backend, BackendChoice, CaptureMode, CaptureStatus, ChunkId, CudaDriver, DeviceAddr, Driver,
    EventFlags, EventId, ExportedChunk, GraphExecId, GraphId, HostAddr, HostDriver,
    HostDriverBuilder, IpcEventHandle, IpcMemHandle, MemInfo, OpenedSegment, SanitizeOptions,
    SanitizedDriver, Sanitizer, SelectedBackend, SimDriver, StreamId, IPC_HANDLE_SIZE,
};
pub use error::{Cause, Error, ErrorKind, ForeignEventFailure, Result};
pub use global::{Global, GLOBAL};
pub use ipc::{
    Drained, IpcHandle, PageSocketLimits, WireHandle, WirePages, PAGE_SECRET_SIZE, WIRE_SIZE,
};
pub use pinned::{DurationStat, PinnedAllocator, PinnedBuffer, PinnedOptions, PinnedStats};
pub use runtime::{Runtime, RuntimeBuilder, SleepReport, WakeOptions, WakeReport};
pub use shm::sweep_orphans;
#[cfg(feature = "cudarc")]
#[cfg_attr(docsrs, doc(cfg(feature = "cudarc")))]
pub use storage::views;
pub use storage::{host_kernel, Storage};

/// The protocol cores that the loom models (`loom_tests/`) and the protocol tests check directly:
/// not part of the API, and free to change in any release.
#[doc(hidden)]
pub mod internals {
    pub use crate::cow::cell;
    pub use crate::driver::cuda::kernels;
    pub use crate::driver::host::StreamGate;
    pub use crate::ipc::{lease_table, limbo};
}

/// The cudarc this crate is built with (feature `cudarc`): use it for your own launches, so the
/// views' traits are the ones your cudarc implements.
#[cfg(feature = "cudarc")]
#[cfg_attr(docsrs, doc(cfg(feature = "cudarc")))]
pub use cudarc;
