//! NVTX's core initialization, done as NVTX's own loader does before it loads an extension
//! (`nvtxExtInitOnce` calls `nvtxInitialize` first): the tool's `InitializeInjectionNvtx2` gets
//! the loader's export tables — the function tables of the core modules, whose slots the tool
//! fills, and the version information — so a tool that sets itself up there (before it serves
//! an extension) sees the same sequence as under any NVTX client. cudalloc makes no core calls:
//! the slots are filled and never called.
//!
//! Layouts from `nvtxDetail/nvtxTypes.h` (NVTX v3): `NvtxExportTableCallbacks`,
//! `NvtxExportTableVersionInfo`; module tables of `SIZE + 1` pointers to function slots, the
//! first (`INVALID`) and the last null.

use std::ffi::{c_int, c_uint, c_void};

use crate::sync::os::atomic::AtomicUsize;
use crate::sync::os::OnceLock;

/// `NVTX_ETID_CALLBACKS`, `NVTX_ETID_VERSIONINFO`.
const EXPORT_CALLBACKS: u32 = 1;
const EXPORT_VERSION_INFO: u32 = 3;

/// `NVTX_CBID_<module>_SIZE` by `NvtxCallbackModule` (1 core, 2 CUDA, 3 OpenCL, 4 CUDA runtime,
/// 5 core 2, 6 sync; 0 is invalid).
const MODULE_SIZES: [usize; 7] = [0, 16, 9, 15, 7, 16, 7];
const ALL_SLOTS: usize = 16 + 9 + 15 + 7 + 16 + 7;

/// The function slots of every core module, filled by the tool.
static SLOTS: [AtomicUsize; ALL_SLOTS] = [const { AtomicUsize::new(0) }; ALL_SLOTS];

/// Each module's table: addresses of its slots (`SIZE + 1` entries, the first and last null).
static TABLES: OnceLock<Vec<Vec<usize>>> = OnceLock::new();

/// `InitializeInjectionNvtx2`'s type: `int (*)(NvtxGetExportTableFunc_t)`; 0 is failure.
pub(super) type InitializeCore = unsafe extern "C" fn(GetExportTable) -> c_int;
/// `NvtxGetExportTableFunc_t`.
pub(super) type GetExportTable = unsafe extern "C" fn(u32) -> *const c_void;

/// `NvtxExportTableCallbacks`.
#[repr(C)]
struct Callbacks {
    struct_size: usize,
    get_module_function_table: unsafe extern "C" fn(c_int, *mut *const usize, *mut c_uint) -> c_int,
}

/// `NvtxExportTableVersionInfo`.
#[repr(C)]
struct VersionInfo {
    struct_size: usize,
    version: u32,
    reserved0: u32,
    set_injection_nvtx_version: unsafe extern "C" fn(u32),
}

static CALLBACKS: Callbacks = Callbacks {
    struct_size: std::mem::size_of::<Callbacks>(),
    get_module_function_table,
};

static VERSION_INFO: VersionInfo = VersionInfo {
    struct_size: std::mem::size_of::<VersionInfo>(),
    version: super::abi::NVTX_VERSION as u32,
    reserved0: 0,
    set_injection_nvtx_version,
};

fn tables() -> &'static Vec<Vec<usize>> {
    TABLES.get_or_init(|| {
        let mut offset = 0;
        MODULE_SIZES
            .iter()
            .map(|&size| {
                if size == 0 {
                    return Vec::new();
                }
                let mut table = vec![0usize; size + 1];
                for (i, entry) in table.iter_mut().enumerate().take(size).skip(1) {
                    *entry = SLOTS[offset + i].as_ptr() as usize;
                }
                offset += size;
                table
            })
            .collect()
    })
}

/// `GetModuleFunctionTable`: module `module`'s table and its size; 0 for a module NVTX does not
/// have.
unsafe extern "C" fn get_module_function_table(
    module: c_int,
    out_table: *mut *const usize,
    out_size: *mut c_uint,
) -> c_int {
    let Some(table) = usize::try_from(module)
        .ok()
        .and_then(|m| tables().get(m))
        .filter(|t| !t.is_empty())
    else {
        return 0;
    };
    if !out_size.is_null() {
        // SAFETY: the tool passes room for the size (NVTX's contract); `table.len() - 1` is the
        // module's `SIZE`, at most 16.
        unsafe { *out_size = (table.len() - 1) as c_uint };
    }
    if !out_table.is_null() {
        // SAFETY: as above, for the table's address; the table lives for the process.
        unsafe { *out_table = table.as_ptr() };
    }
    1
}

/// `SetInjectionNvtxVersion`: reserved by NVTX, ignored.
unsafe extern "C" fn set_injection_nvtx_version(_version: u32) {}

/// `nvtxGetExportTable`.
unsafe extern "C" fn get_export_table(id: u32) -> *const c_void {
    match id {
        EXPORT_CALLBACKS => (&CALLBACKS as *const Callbacks).cast(),
        EXPORT_VERSION_INFO => (&VERSION_INFO as *const VersionInfo).cast(),
        _ => std::ptr::null(),
    }
}

/// Runs the tool's core entry point, when it has one. Its answer is logged, not acted on: NVTX's
/// loader goes on to the extension whatever the core said.
pub(super) fn initialize(library: &libloading::Library) {
    // SAFETY: NVTX's ABI gives this symbol the type `InitializeCore`.
    let init = match unsafe { library.get::<InitializeCore>(b"InitializeInjectionNvtx2\0") } {
        Ok(symbol) => *symbol,
        Err(_) => {
            tracing::debug!("the NVTX tool has no core entry point");
            return;
        }
    };
    // SAFETY: `get_export_table` and the tables it hands out are static; `init` is the tool's
    // entry point, kept alive by `library`.
    let status = unsafe { init(get_export_table) };
    if status == 0 {
        tracing::debug!("the NVTX tool's core initialization returned failure");
    }
}
