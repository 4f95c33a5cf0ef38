//! `GLOBAL`: the process-wide runtime a tensor library allocates through.
//!
//! **One door.** A library names the allocator in one way: `GLOBAL.get()?` hands out the
//! process's `&Arc<Runtime>`, and the [`Runtime`] is the allocator's face — every
//! [`CachingAllocator`](crate::CachingAllocator) method through `Deref` (one definition, nothing
//! that can drift), plus the IPC administration (`ipc_collect`, limbo, drains). `Global` itself
//! only sets the runtime up, says how (`backend`, `fallback_reason`) and makes storages; it
//! forwards nothing (it once hand-wrote 23 allocator forwarders, which had drifted: one was
//! missing). A [`CachingAllocator`](crate::CachingAllocator) built by hand stays the door for
//! embedders that bring their own driver and need no sharing.
//!
//! ```no_run
//! use cudalloc::GLOBAL;
//! # fn main() -> cudalloc::Result<()> {
//! let storage = GLOBAL.storage(0, 1 << 20)?;
//! let runtime = GLOBAL.get()?;
//! println!("{} bytes allocated", runtime.memory_stats(0)?.allocated_bytes.all.current);
//! # drop(storage);
//! # Ok(())
//! # }
//! ```
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

use crate::config::AllocatorConfig;
use crate::driver::{Backend, BackendChoice, Driver, StreamId};
use crate::error::{Error, Result};
use crate::runtime::{Runtime, RuntimeBuilder};
use crate::storage::Storage;
use crate::sync::os::{Arc, OnceLock};

/// The process-wide runtime (one door: see the crate docs and `src/global.rs`).
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

    /// A new storage of `nbytes` on `device`'s current stream.
    pub fn storage(&self, device: usize, nbytes: u64) -> Result<Storage> {
        Storage::new(self.get()?, device, nbytes)
    }

    /// A new storage of `nbytes` for use on `stream` (no guard needed); see [`Storage::new_on`].
    pub fn storage_on(&self, stream: StreamId, nbytes: u64) -> Result<Storage> {
        Storage::new_on(self.get()?, stream, nbytes)
    }
}
