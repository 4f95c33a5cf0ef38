//! # cudalloc
//!
//! A CUDA caching allocator with cross-process IPC sharing and copy-on-write lazy clones, meant to
//! be the global GPU allocator of a Rust tensor library. Everything runs and is tested without a GPU
//! on a real host backend ([`HostDriver`]); the CUDA backend ([`CudaDriver`]) is loaded at run time.
//!
//! Layers (bottom up): [`driver`] — the [`Driver`] trait and its two backends.

pub mod driver;
mod error;
mod sync;

pub use driver::{
    Backend, BackendChoice, CudaDriver, DevicePtr, Driver, EventFlags, EventId, HostDriver,
    HostDriverBuilder, IpcEventHandle, IpcMemHandle, MemInfo, OpenedSegment, SelectedBackend,
    StreamId,
};
pub use error::{Error, ErrorKind, Result};
