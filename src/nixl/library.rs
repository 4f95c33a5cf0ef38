//! Finding NIXL's C library (`libnixl_capi.so`) at run time.
//!
//! `nixl-sys` is built with its `stub-api` feature: every NIXL call goes through a stub that opens
//! `libnixl_capi.so` by name on first use and **aborts the process** if it cannot. So nothing here
//! calls into NIXL before this module has opened the library itself (from a folder given by the
//! caller or by `CUDALLOC_NIXL_LIB_DIR`, else from the library path) and the stub agrees it is
//! real: a missing library is a clear [`Error::Transfer`], never an abort, and never a silent stub.
//! The library stays loaded for the life of the process (NIXL keeps threads and plugins).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::sync::os::{Mutex, OnceLock};

/// Environment variable naming the folder that holds `libnixl_capi.so` (the NIXL wheel's
/// `.nixl_cu12.mesonpy.libs`), when it is not on the library path.
pub const NIXL_LIB_DIR_VAR: &str = "CUDALLOC_NIXL_LIB_DIR";

const LIBRARY: &str = "libnixl_capi.so";

/// Where the NIXL library was loaded from.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct NixlLibrary {
    /// The file opened, or the bare name when the library path found it.
    pub path: PathBuf,
}

static LOADED: OnceLock<NixlLibrary> = OnceLock::new();
static LOADING: Mutex<()> = Mutex::new(());

/// Loads NIXL's C library from `dir` (or `CUDALLOC_NIXL_LIB_DIR`, or the library path) and checks
/// that it is the real one; later calls return the first success. Every other NIXL entry point of
/// this crate calls it first.
pub fn load_library(dir: Option<&Path>) -> Result<NixlLibrary> {
    if let Some(done) = LOADED.get() {
        return Ok(done.clone());
    }
    let _one_at_a_time = LOADING.lock();
    if let Some(done) = LOADED.get() {
        return Ok(done.clone());
    }
    let from_env = std::env::var_os(NIXL_LIB_DIR_VAR).map(PathBuf::from);
    let path = match dir.map(Path::to_path_buf).or(from_env) {
        Some(dir) => {
            let file = dir.join(LIBRARY);
            if !file.is_file() {
                return Err(Error::transfer(format!(
                    "NIXL's {LIBRARY} is not in {} (set {NIXL_LIB_DIR_VAR} to the folder of the \
                     nixl wheel's .nixl_cu12.mesonpy.libs, or put it on LD_LIBRARY_PATH)",
                    dir.display()
                )));
            }
            file
        }
        None => PathBuf::from(LIBRARY),
    };
    let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL;
    // SAFETY: opening NIXL's C library runs its initializers, which only set up NIXL's own state;
    // the handle is kept for the whole process (forgotten below), so nothing it loaded is ever
    // unloaded under a thread or pointer of NIXL's.
    let opened = unsafe { libloading::os::unix::Library::open(Some(&path), flags) };
    let library = opened.map_err(|err| {
        Error::transfer(format!(
            "NIXL's C library could not be loaded from {}: {err} (set {NIXL_LIB_DIR_VAR} or \
             LD_LIBRARY_PATH to the folder holding {LIBRARY})",
            path.display()
        ))
    })?;
    std::mem::forget(library);
    // The stub now opens the same library by its name; it must not be a stub.
    if nixl_sys::is_stub() {
        return Err(Error::transfer(format!(
            "{} was loaded, but nixl-sys still runs its stub (it did not find {LIBRARY} by name)",
            path.display()
        )));
    }
    let done = NixlLibrary { path };
    tracing::debug!(path = %done.path.display(), "NIXL library loaded");
    Ok(LOADED.get_or_init(|| done).clone())
}
