//! `GLOBAL`: the process-wide runtime a tensor library allocates through.
//!
//! It is set up once, in one of two ways, and never changes afterwards:
//!
//! | how                                     | backend                                  | allocator settings         |
//! |-----------------------------------------|------------------------------------------|----------------------------|
//! | [`Global::init`] (before any other use) | the [`BackendChoice`] given              | the [`RuntimeBuilder`]'s   |
//! | [`Global::init_with_driver`]            | the driver given (e.g. a `HostDriver` built for tests) | the builder's |
//! | first use of anything else              | `CUDALLOC_BACKEND` (default `auto`)      | `CUDALLOC_CONF`            |
//!
//! `init` after `GLOBAL` was set up (by an earlier `init` or by first use) is an
//! [`ErrorKind::Config`](crate::ErrorKind::Config) error saying so — never a silent second
//! configuration. If the environment is invalid, every call returns the same configuration error
//! (built once, never a panic). With `auto`, falling back to the host backend is logged as a
//! warning naming why CUDA was not used, and [`Global::fallback_reason`] returns it.

use std::collections::BTreeMap;

use crate::alloc::{
    DataPtr, DeviceStats, FreeMemoryCallback, OutOfMemoryObserver, SegmentObserver, Snapshot,
    StreamGuard,
};
use crate::config::AllocatorConfig;
use crate::driver::{Backend, BackendChoice, Driver, StreamId};
use crate::error::{Error, Result};
use crate::runtime::{Runtime, RuntimeBuilder};
use crate::storage::Storage;
use crate::sync::os::{Arc, OnceLock};

/// The process-wide runtime (see the [module docs](self)).
pub static GLOBAL: Global = Global {
    cell: OnceLock::new(),
};

/// What `GLOBAL` was set up with.
#[derive(Debug)]
struct Ready {
    runtime: Arc<Runtime>,
    fallback_reason: Option<String>,
}

/// The type of [`GLOBAL`].
#[derive(Debug)]
pub struct Global {
    cell: OnceLock<Result<Ready>>,
}

/// Forwards `Global` methods to the runtime (building it on first use).
macro_rules! forward {
    ($($(#[$doc:meta])* fn $name:ident(&self $(, $arg:ident: $ty:ty)*) -> $ret:ty;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(&self $(, $arg: $ty)*) -> Result<$ret> {
                self.get()?.$name($($arg),*)
            }
        )*
    };
}

/// Forwards `Global` methods that cannot fail once the runtime exists.
macro_rules! forward_infallible {
    ($($(#[$doc:meta])* fn $name:ident(&self $(, $arg:ident: $ty:ty)*) -> $ret:ty;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(&self $(, $arg: $ty)*) -> Result<$ret> {
                Ok(self.get()?.$name($($arg),*))
            }
        )*
    };
}

impl Global {
    fn ready(&self) -> Result<&Ready> {
        self.cell
            .get_or_init(|| {
                let backend = BackendChoice::from_env()?.open()?;
                let config = AllocatorConfig::from_env()?;
                let runtime = Runtime::builder().config(config).build(backend.driver)?;
                tracing::info!(backend = %runtime.driver().backend(), "cudalloc GLOBAL ready (from the environment)");
                Ok(Ready {
                    runtime: Arc::new(runtime),
                    fallback_reason: backend.fallback_reason,
                })
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The runtime, set up from the environment on first use unless [`Global::init`] came first.
    pub fn get(&self) -> Result<&Arc<Runtime>> {
        self.ready().map(|r| &r.runtime)
    }

    fn install(&self, build: impl FnOnce() -> Result<Ready>) -> Result<&Arc<Runtime>> {
        let mut installed = false;
        let ready = self.cell.get_or_init(|| {
            installed = true;
            build()
        });
        if !installed {
            return Err(Error::Config(match ready {
                Ok(_) => "GLOBAL is already set up (by an earlier init or by its first use): call \
                          GLOBAL.init before anything else uses GLOBAL"
                    .into(),
                Err(first) => format!(
                    "GLOBAL was set up earlier and that setup failed ({first}); it keeps answering \
                     that error: call GLOBAL.init before anything else uses GLOBAL"
                ),
            }));
        }
        ready.as_ref().map(|r| &r.runtime).map_err(Clone::clone)
    }

    /// Sets `GLOBAL` up from code: `backend` chosen as `CUDALLOC_BACKEND` would choose it, the
    /// allocator configured by `builder` (`CUDALLOC_CONF` is not read). Call once, before any
    /// other use of `GLOBAL`; afterwards it is a configuration error. If building fails, that
    /// error is what `GLOBAL` answers from then on.
    pub fn init(&self, builder: RuntimeBuilder, backend: BackendChoice) -> Result<&Arc<Runtime>> {
        self.install(|| {
            let selected = backend.open()?;
            Ok(Ready {
                runtime: Arc::new(builder.build(selected.driver)?),
                fallback_reason: selected.fallback_reason,
            })
        })
    }

    /// As [`Global::init`], over a driver the caller built.
    pub fn init_with_driver(
        &self,
        builder: RuntimeBuilder,
        driver: Arc<dyn Driver>,
    ) -> Result<&Arc<Runtime>> {
        self.install(|| {
            Ok(Ready {
                runtime: Arc::new(builder.build(driver)?),
                fallback_reason: None,
            })
        })
    }

    /// The backend `GLOBAL` runs on.
    pub fn backend(&self) -> Result<Backend> {
        Ok(self.get()?.driver().backend())
    }

    /// With `auto`, why the CUDA backend was not used (`None` when it was, or was not asked for).
    pub fn fallback_reason(&self) -> Result<Option<String>> {
        Ok(self.ready()?.fallback_reason.clone())
    }

    /// Adopts a library's stream by its raw handle; see
    /// [`CachingAllocator::import_stream`](crate::CachingAllocator::import_stream).
    ///
    /// # Safety
    /// As for [`CachingAllocator::import_stream`](crate::CachingAllocator::import_stream).
    pub unsafe fn import_stream(&self, device: usize, raw: u64) -> Result<StreamId> {
        let runtime = self.get()?;
        // SAFETY: forwarded; the caller upholds the contract.
        unsafe { runtime.import_stream(device, raw) }
    }

    /// A new storage of `nbytes` on `device`'s current stream.
    pub fn storage(&self, device: usize, nbytes: u64) -> Result<Storage> {
        Storage::new(self.get()?, device, nbytes)
    }

    /// A new storage of `nbytes` for use on `stream` (no guard needed); see [`Storage::new_on`].
    pub fn storage_on(&self, stream: StreamId, nbytes: u64) -> Result<Storage> {
        Storage::new_on(self.get()?, stream, nbytes)
    }

    forward! {
        /// See [`CachingAllocator::allocate`](crate::CachingAllocator::allocate).
        fn allocate(&self, device: usize, size: u64) -> DataPtr;
        /// See [`CachingAllocator::allocate_on`](crate::CachingAllocator::allocate_on).
        fn allocate_on(&self, stream: StreamId, size: u64) -> DataPtr;
        /// See [`CachingAllocator::memory_stats`](crate::CachingAllocator::memory_stats).
        fn memory_stats(&self, device: usize) -> DeviceStats;
        /// See [`CachingAllocator::memory_stats_map`](crate::CachingAllocator::memory_stats_map).
        fn memory_stats_map(&self, device: usize) -> BTreeMap<String, i64>;
        /// See [`CachingAllocator::reset_peak_memory_stats`](crate::CachingAllocator::reset_peak_memory_stats).
        fn reset_peak_memory_stats(&self, device: usize) -> ();
        /// See [`CachingAllocator::reset_accumulated_memory_stats`](crate::CachingAllocator::reset_accumulated_memory_stats).
        fn reset_accumulated_memory_stats(&self, device: usize) -> ();
        /// See [`CachingAllocator::memory_summary`](crate::CachingAllocator::memory_summary).
        fn memory_summary(&self, device: usize) -> String;
        /// See [`CachingAllocator::default_stream`](crate::CachingAllocator::default_stream).
        fn default_stream(&self, device: usize) -> StreamId;
        /// See [`CachingAllocator::current_stream`](crate::CachingAllocator::current_stream).
        fn current_stream(&self, device: usize) -> StreamId;
        /// See [`CachingAllocator::set_current_stream`](crate::CachingAllocator::set_current_stream).
        fn set_current_stream(&self, stream: StreamId) -> StreamGuard;
        /// See [`CachingAllocator::create_stream`](crate::CachingAllocator::create_stream).
        fn create_stream(&self, device: usize) -> StreamId;
        /// See [`CachingAllocator::record_stream`](crate::CachingAllocator::record_stream).
        fn record_stream(&self, data: &DataPtr, stream: StreamId) -> ();
        /// See [`CachingAllocator::set_per_process_memory_fraction`](crate::CachingAllocator::set_per_process_memory_fraction).
        fn set_per_process_memory_fraction(&self, fraction: f64, device: usize) -> ();
        /// See [`CachingAllocator::reserved_bytes`](crate::CachingAllocator::reserved_bytes).
        fn reserved_bytes(&self, device: usize) -> u64;
        /// See [`CachingAllocator::raw_stream`](crate::CachingAllocator::raw_stream).
        fn raw_stream(&self, stream: StreamId) -> u64;
        /// See [`CachingAllocator::set_default_stream`](crate::CachingAllocator::set_default_stream).
        fn set_default_stream(&self, stream: StreamId) -> ();
        /// See [`CachingAllocator::clear_default_stream`](crate::CachingAllocator::clear_default_stream).
        fn clear_default_stream(&self, device: usize) -> ();
    }

    forward_infallible! {
        /// See [`CachingAllocator::device_count`](crate::CachingAllocator::device_count).
        fn device_count(&self) -> usize;
        /// See [`CachingAllocator::empty_cache`](crate::CachingAllocator::empty_cache).
        fn empty_cache(&self) -> ();
        /// See [`CachingAllocator::snapshot`](crate::CachingAllocator::snapshot).
        fn snapshot(&self) -> Snapshot;
        /// See [`CachingAllocator::record_history`](crate::CachingAllocator::record_history).
        fn record_history(&self, enabled: bool, max_entries: usize) -> ();
        /// See [`CachingAllocator::register_free_memory_callback`](crate::CachingAllocator::register_free_memory_callback).
        fn register_free_memory_callback(&self, callback: FreeMemoryCallback) -> ();
        /// See [`CachingAllocator::register_segment_observer`](crate::CachingAllocator::register_segment_observer).
        fn register_segment_observer(&self, observer: SegmentObserver) -> ();
        /// See [`CachingAllocator::register_out_of_memory_observer`](crate::CachingAllocator::register_out_of_memory_observer).
        fn register_out_of_memory_observer(&self, observer: OutOfMemoryObserver) -> ();
        /// See [`Runtime::ipc_collect`].
        fn ipc_collect(&self) -> bool;
    }
}
