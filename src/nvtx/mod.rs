//! A client of NVTX's memory extension: tells a tool attached to the process (NVIDIA's
//! compute-sanitizer with `--nvtx yes`, Nsight Systems) which ranges are the allocator's heaps
//! and which parts of them are live allocations, so a tool that checks bounds sees inside a
//! caching allocator's segments.
//!
//! No maintained Rust crate binds the memory extension (`nvtx-sys` binds the core and sync
//! headers), so the extension's loading protocol is followed here, written from NVTX v3's
//! published headers (`nvtxExtInit.h`, `nvToolsExtMem.h`; layouts in `abi.rs`):
//!
//! | step | what happens |
//! |---|---|
//! | find the tool | the library named by `NVTX_INJECTION64_PATH` (loaded, its `InitializeInjectionNvtxExtension`); without the variable, a tool already in the process (`InitializeInjectionNvtxExtensionPreinject`); neither: no tool, every call is skipped |
//! | the core first | as NVTX's loader initializes the core before any extension, the loaded tool's `InitializeInjectionNvtx2` gets export tables (`core_init.rs`); its answer does not stop the extension's loading (nor NVTX's) |
//! | initialize | one `nvtxExtModuleInfo_t` for module 1 (memory), compat id `0x0102`, one segment of 63 function slots (a static array); the tool fills the slots it implements and returns non-zero |
//! | call | heap register / unregister (slots 0, 1), regions register / unregister (slots 3, 5), in NVTX's default domain (a null handle); a slot the tool left empty disables the client |
//!
//! Loaded once per process, on the first allocator built with `nvtx_regions:True` (an NVTX tool
//! initializes once per process); the library is never unloaded, even when it refuses the
//! extension (its initialization may have started threads), as NVTX's own loader never unloads
//! it. A heap the tool registers as a null handle is no heap (its regions are not registered).

mod abi;
mod core_init;

use std::ffi::{c_void, CString};

use crate::sync::os::atomic::{AtomicIsize, Ordering};
use crate::sync::os::OnceLock;

// The layouts in `abi.rs` are those of 64-bit targets.
const _: () = assert!(std::mem::size_of::<usize>() == 8);

/// The function slots of the memory extension, filled by the tool: static, as NVTX's own client
/// keeps them, since a tool may call through them for the process's life.
static SLOTS: [AtomicIsize; abi::SLOT_COUNT] = [const { AtomicIsize::new(0) }; abi::SLOT_COUNT];

/// The tool of this process, once looked for.
static TOOL: OnceLock<Option<MemoryTool>> = OnceLock::new();

/// A heap a tool registered (its opaque handle).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HeapHandle(usize);

/// The memory functions of the NVTX tool attached to this process.
pub(crate) struct MemoryTool {
    heap_register: abi::HeapRegister,
    heap_unregister: abi::HeapUnregister,
    regions_register: abi::RegionsRegister,
    regions_unregister: abi::RegionsUnregister,
    /// The loaded tool library (none for a tool already in the process), never unloaded.
    _library: Option<libloading::Library>,
}

impl std::fmt::Debug for MemoryTool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryTool")
            .field("loaded", &self._library.is_some())
            .finish()
    }
}

/// The NVTX tool attached to this process, if any (looked for once).
pub(crate) fn tool() -> Option<&'static MemoryTool> {
    TOOL.get_or_init(load).as_ref()
}

/// Finds and initializes the tool (the module docs' table); `None`, logged, when there is none or
/// it cannot serve the memory extension.
fn load() -> Option<MemoryTool> {
    let (library, init) = match std::env::var_os("NVTX_INJECTION64_PATH") {
        Some(path) => {
            // SAFETY: loading runs the library's initializers; the library is the NVTX tool the
            // process was started with (the variable's documented meaning), loaded for this.
            let library = match unsafe { libloading::Library::new(&path) } {
                Ok(library) => library,
                Err(err) => {
                    tracing::warn!(%err, ?path, "NVTX_INJECTION64_PATH names a library that does not load; NVTX memory regions are off");
                    return None;
                }
            };
            // SAFETY: NVTX's ABI gives this symbol the type `NvtxExtInitializeInjectionFunc_t`.
            let init = match unsafe {
                library.get::<abi::InitializeInjection>(b"InitializeInjectionNvtxExtension\0")
            } {
                Ok(symbol) => *symbol,
                Err(err) => {
                    tracing::warn!(%err, ?path, "the NVTX tool has no InitializeInjectionNvtxExtension; NVTX memory regions are off");
                    return None;
                }
            };
            core_init::initialize(&library);
            (Some(library), init)
        }
        None => {
            let process = libloading::os::unix::Library::this();
            // SAFETY: as above, for the entry point of a tool already in the process.
            match unsafe {
                process
                    .get::<abi::InitializeInjection>(b"InitializeInjectionNvtxExtensionPreinject\0")
            } {
                Ok(symbol) => (None, *symbol),
                Err(_) => {
                    tracing::info!("nvtx_regions: no NVTX tool is attached to this process (NVTX_INJECTION64_PATH is not set); nothing is reported");
                    return None;
                }
            }
        }
    };
    let mut segment = abi::ModuleSegment {
        segment_id: abi::SEGMENT_ID,
        slot_count: abi::SLOT_COUNT,
        // `AtomicIsize` has `isize`'s layout; the tool writes the slots during `init` only.
        function_slots: SLOTS.as_ptr() as *mut isize,
    };
    let mut info = abi::ModuleInfo {
        nvtx_version: abi::NVTX_VERSION,
        struct_size: abi::struct_size::<abi::ModuleInfo>(),
        module_id: abi::MODULE_ID_MEM,
        compat_id: abi::COMPAT_ID_MEM,
        segments_count: 1,
        segments: &mut segment,
        get_export_function: std::ptr::null(),
        ext_info: std::ptr::null(),
    };
    // SAFETY: `info` and `segment` are valid for the call and laid out as NVTX's
    // `nvtxExtModuleInfo_t`; the slots they point at are static. `init` is the tool's entry
    // point, kept alive by `library` (or by the process).
    let status = unsafe { init(&mut info) };
    if status == 0 {
        tracing::warn!("the NVTX tool refused the memory extension; NVTX memory regions are off");
        std::mem::forget(library);
        return None;
    }
    let slot = |i: usize| {
        let value = SLOTS[i].load(Ordering::Acquire);
        (value != abi::SLOT_FRESH && value != abi::SLOT_DISABLED).then_some(value)
    };
    let (
        Some(heap_register),
        Some(heap_unregister),
        Some(regions_register),
        Some(regions_unregister),
    ) = (
        slot(abi::SLOT_HEAP_REGISTER),
        slot(abi::SLOT_HEAP_UNREGISTER),
        slot(abi::SLOT_REGIONS_REGISTER),
        slot(abi::SLOT_REGIONS_UNREGISTER),
    )
    else {
        tracing::warn!("the NVTX tool does not implement heap and region registration; NVTX memory regions are off");
        std::mem::forget(library);
        return None;
    };
    tracing::info!("nvtx_regions: an NVTX tool is attached; heaps and regions are reported");
    // SAFETY: a slot the tool filled holds its implementation of that slot's NVTX function,
    // whose C type each alias in `abi.rs` spells.
    unsafe {
        Some(MemoryTool {
            heap_register: std::mem::transmute::<isize, abi::HeapRegister>(heap_register),
            heap_unregister: std::mem::transmute::<isize, abi::HeapUnregister>(heap_unregister),
            regions_register: std::mem::transmute::<isize, abi::RegionsRegister>(regions_register),
            regions_unregister: std::mem::transmute::<isize, abi::RegionsUnregister>(
                regions_unregister,
            ),
            _library: library,
        })
    }
}

impl MemoryTool {
    /// Registers `[base, base + size)` as a heap sub-allocated by regions, named `name`; `None`
    /// when the tool answers with a null handle (NVTX's process-wide heap, not one to put
    /// regions in or unregister).
    pub(crate) fn register_heap(&self, base: u64, size: u64, name: &str) -> Option<HeapHandle> {
        let name = CString::new(name.replace('\0', " ")).unwrap_or_default();
        let range = abi::VirtualRange {
            size: size as usize,
            ptr: base as usize as *const c_void,
        };
        let desc = abi::HeapDesc {
            ext_compat_id: abi::COMPAT_ID_MEM,
            struct_size: abi::struct_size::<abi::HeapDesc>(),
            reserved0: 0,
            usage: abi::HEAP_USAGE_SUB_ALLOCATOR,
            mem_type: abi::MEM_TYPE_VIRTUAL_ADDRESS,
            type_specific_desc_size: std::mem::size_of::<abi::VirtualRange>(),
            type_specific_desc: (&range as *const abi::VirtualRange).cast(),
            category: 0,
            message_type: abi::MESSAGE_ASCII,
            message: name.as_ptr(),
        };
        // SAFETY: the descriptor, the range and the name it points at are valid for the call;
        // the default domain is a null handle.
        let handle = unsafe { (self.heap_register)(std::ptr::null_mut(), &desc) };
        (!handle.is_null()).then_some(HeapHandle(handle as usize))
    }

    /// Unregisters `heap` (and with it every region registered in it).
    pub(crate) fn unregister_heap(&self, heap: HeapHandle) {
        // SAFETY: `heap` is a handle this tool returned and that was not unregistered since
        // (the caller's bookkeeping, `alloc/nvtx_regions.rs`).
        unsafe { (self.heap_unregister)(std::ptr::null_mut(), heap.0 as *mut c_void) }
    }

    /// Registers `regions` (`(start, size)`, each inside `heap`) as live allocations of `heap`.
    pub(crate) fn register_regions(&self, heap: HeapHandle, regions: &[(u64, u64)]) {
        if regions.is_empty() {
            return;
        }
        let ranges: Vec<abi::VirtualRange> = regions
            .iter()
            .map(|&(start, size)| abi::VirtualRange {
                size: size as usize,
                ptr: start as usize as *const c_void,
            })
            .collect();
        let mut handles: Vec<*mut c_void> = vec![std::ptr::null_mut(); ranges.len()];
        let batch = abi::RegionsRegisterBatch {
            ext_compat_id: abi::COMPAT_ID_MEM,
            struct_size: abi::struct_size::<abi::RegionsRegisterBatch>(),
            region_type: abi::MEM_TYPE_VIRTUAL_ADDRESS,
            heap: heap.0 as *mut c_void,
            region_count: ranges.len(),
            region_desc_element_size: std::mem::size_of::<abi::VirtualRange>(),
            region_desc_elements: ranges.as_ptr().cast(),
            region_handle_elements_out: handles.as_mut_ptr(),
        };
        // SAFETY: the batch, its ranges and the handles' room (one per range) are valid for
        // the call; `heap` is live.
        unsafe { (self.regions_register)(std::ptr::null_mut(), &batch) }
    }

    /// Unregisters the regions that start at `starts`.
    pub(crate) fn unregister_regions(&self, starts: &[u64]) {
        if starts.is_empty() {
            return;
        }
        let refs: Vec<*const c_void> = starts
            .iter()
            .map(|&start| start as usize as *const c_void)
            .collect();
        let batch = abi::RegionsUnregisterBatch {
            ext_compat_id: abi::COMPAT_ID_MEM,
            struct_size: abi::struct_size::<abi::RegionsUnregisterBatch>(),
            ref_type: abi::REGION_REF_POINTER,
            ref_count: refs.len(),
            ref_element_size: std::mem::size_of::<*const c_void>(),
            ref_elements: refs.as_ptr(),
        };
        // SAFETY: the batch and its references are valid for the call.
        unsafe { (self.regions_unregister)(std::ptr::null_mut(), &batch) }
    }
}
