//! A CUDA caching allocator for Rust with cross-process sharing and copy-on-write built in: the
//! global GPU allocator of a tensor library, as PyTorch's `CUDACachingAllocator`, its CUDA IPC
//! reference counting and its COW storage are to PyTorch. Everything runs without a GPU on a real
//! host backend; the CUDA backend is loaded at run time.
//!
//! A program talks to [`GLOBAL`] (or a [`Runtime`] of its own) and holds [`Storage`]s: their
//! doors order every access on a stream (`data_ptr()` on the current one, `data_ptr_on(stream)`
//! on another; the unordered address is [`Storage::unordered_data_ptr`]). The README has a
//! tensor library in five minutes; the guides, one concern each:
//!
//! | guide | what it covers |
//! |---|---|
//! | [`guide::tensor_library`] | `GLOBAL`, configuration from code, your streams, cudarc views, typed host kernels |
//! | [`guide::streams`] | the ordering storages do, the manual rules, the sanitizer, lazy clones |
//! | [`guide::sharing`] | storages shared with other processes |
//! | [`guide::pools_and_graphs`] | memory pools, captures and graphs |
//! | [`guide::sleep`] | sleep and wake by tag |
//! | [`guide::pinned`] | page-locked host memory |
//! | [`guide::nixl`] | registration and NIXL transfers |
//! | [`guide::replay`] | history, snapshots, replay |
//! | [`guide::configuration`] | every environment variable and configuration key |
//! | [`guide::architecture`] | status, the CUDA contract double, the source layout |
// Feature badges on docs.rs (nightly rustdoc with `--cfg docsrs`; see `[package.metadata.docs.rs]`).
#![cfg_attr(docsrs, feature(doc_cfg))]
//!
//! ## Layers of the crate
//!
//! Everything runs and is tested without a GPU on a real host backend ([`HostDriver`](backend::HostDriver)); the CUDA
//! backend ([`CudaDriver`](backend::CudaDriver)) is loaded at run time. Layers, bottom up (a module never imports a layer above it; `tests/layering.rs` checks it):
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

/// The guides (`docs/guide/*.md`), one concern each; their examples are tested.
pub mod guide {
    #[doc = include_str!("../docs/guide/tensor-library.md")]
    pub mod tensor_library {}
    #[doc = include_str!("../docs/guide/streams.md")]
    pub mod streams {}
    #[doc = include_str!("../docs/guide/sharing.md")]
    pub mod sharing {}
    #[doc = include_str!("../docs/guide/pools-and-graphs.md")]
    pub mod pools_and_graphs {}
    #[doc = include_str!("../docs/guide/sleep.md")]
    pub mod sleep {}
    #[doc = include_str!("../docs/guide/pinned.md")]
    pub mod pinned {}
    #[doc = include_str!("../docs/guide/nixl.md")]
    pub mod nixl {}
    #[doc = include_str!("../docs/guide/replay.md")]
    pub mod replay {}
    #[doc = include_str!("../docs/guide/configuration.md")]
    pub mod configuration {}
    #[doc = include_str!("../docs/guide/architecture.md")]
    pub mod architecture {}
}

/// The README's examples, run as doctests (the README is written for the repository's page; the
/// crate's front page is above).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
mod config;
mod cow;
mod driver;
mod error;
mod global;
pub mod ipc;
#[cfg(feature = "nccl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
pub mod nccl;
#[cfg(feature = "nixl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nixl")))]
pub mod nixl;
mod nvtx;
pub mod pinned;
mod process;
#[cfg(feature = "replay")]
#[cfg_attr(docsrs, doc(cfg(feature = "replay")))]
pub mod replay;
mod runtime;
mod shm;
mod storage;
mod sync;

// One door (see "The public surface" in the crate docs): a library talks to `GLOBAL` and the
// `Runtime` it hands out; embedders with a driver of their own build a `Runtime` over it. What a
// program names every day is at the root; the rest is grouped by concern in the modules below.
// Every public item has one path; `docs/public-api.txt` lists them (`tests/public_api.rs`).
pub use alloc::{format_size, ConfigOverride, DataPtr, StreamGuard};
pub use config::{AllocatorConfig, CrossStreamReuse, DefaultStream, StreamOrder};
pub use driver::host::parse_byte_size;
pub use driver::{DeviceAddr, StreamId};
pub use error::{Cause, Error, ErrorKind, ForeignEventFailure, Result};
pub use global::{Global, GLOBAL};
pub use runtime::{Event, Runtime, RuntimeBuilder, SleepReport, WakeOptions, WakeReport};

/// The device layer: the [`Driver`](backend::Driver) trait and its capabilities, the backends
/// (host, CUDA, simulated, sanitized), and the handles and ids a driver deals in. A program
/// chooses a backend here and hands it to a [`Runtime`]; drivers of one's own implement the
/// traits.
pub mod backend {
    pub use crate::driver::capability;
    pub use crate::driver::cuda::driver_library_present;
    pub use crate::driver::host::{HostKernelMemory, HostRange};
    pub use crate::driver::sim::MAX_SIM_DEVICES;
    pub use crate::driver::{
        Backend, BackendChoice, CaptureStatus, ChunkId, CudaDriver, Driver, EventFlags, EventId,
        ExportedChunk, GraphExecId, GraphId, HostAddr, HostDriver, HostDriverBuilder,
        IpcEventHandle, IpcMemHandle, MemInfo, OpenedSegment, SanitizedDriver, SelectedBackend,
        SimDriver, IPC_HANDLE_SIZE,
    };
}

/// The stream sanitizer (`CUDALLOC_SANITIZE`): its options, its reports and what they name.
pub mod sanitizer {
    pub use crate::alloc::Sanitize;
    pub use crate::driver::sanitizer::{
        AccessKind, AccessReport, HazardKind, HazardReport, SanitizeOptions, Sanitizer, Touch,
    };
}

/// What an allocator tells of itself: statistics (PyTorch's keys), snapshots, the memory history,
/// out-of-memory facts, and the observers and callbacks that hear of them.
pub mod stats {
    pub use crate::alloc::{
        trace_json_lines, Bookkeeping, DeviceStats, Frame, FreeMemoryCallback, HistoryMode,
        HistoryOptions, OutOfMemoryEvent, OutOfMemoryObserver, PoolStats, PoolsReserved,
        SegmentChange, SegmentEvent, SegmentObserver, Snapshot, SnapshotBlock, SnapshotBlockState,
        SnapshotSegment, Stat, TraceAction, TraceEntry,
    };
}

/// Stream capture and CUDA graphs through the allocator (PyTorch's `torch.cuda.graph`).
pub mod graph {
    pub use crate::alloc::{Capture, CaptureRoute, Graph, GraphPool};
    pub use crate::driver::CaptureMode;
}

/// Private memory pools (PyTorch's `MemPool`, `use_mem_pool`), which tags and graphs are too.
pub mod pool {
    pub use crate::alloc::{MemPool, MemPoolId, MemPoolOptions, PoolScope};
}

/// Registering mapped memory with transfer engines (NIXL, NCCL, your own): the regions, the
/// registrars and their figures.
pub mod registration {
    pub use crate::alloc::{
        OnRegistrationFailure, Region, RegionKind, RegisteredRegion, Registrar, RegistrarId,
        RegistrarStats, RegistrationStats, SegmentId,
    };
}

#[cfg(feature = "cudarc")]
#[cfg_attr(docsrs, doc(cfg(feature = "cudarc")))]
pub use storage::views;
pub use storage::{host_kernel, kernel, Storage};

/// What the loom models (`loom_tests/`) and the protocol tests reach directly — the protocol
/// cores, a host stream's gate, the pattern kernels' reference bytes, the IPC wire format's
/// decoded fields (a handle travels only as `IpcHandle::into_bytes`): not part of the API, and
/// free to change in any release.
#[doc(hidden)]
pub mod internals {
    pub use crate::cow::cell;
    pub use crate::driver::cuda::kernels;
    pub use crate::driver::host::StreamGate;
    pub use crate::driver::pattern;
    pub use crate::ipc::{lease_table, limbo, WireHandle, WirePages, PAGE_SECRET_SIZE, WIRE_SIZE};
}

/// The cudarc this crate is built with (feature `cudarc`): use it for your own launches, so the
/// views' traits are the ones your cudarc implements.
#[cfg(feature = "cudarc")]
#[cfg_attr(docsrs, doc(cfg(feature = "cudarc")))]
pub use cudarc;
