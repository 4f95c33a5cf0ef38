//! An NVTX injection library for tests: what compute-sanitizer is to a program that describes its
//! memory with NVTX's memory extension, without a GPU. Named by `NVTX_INJECTION64_PATH`, it fills
//! the memory extension's heap and region slots, keeps the heaps and regions registered, and
//! records every breach of the extension's rules as an error:
//!
//! * a heap that overlaps a registered heap, or (with `NVTX_RECORDER_CHECK_MAPPED=1`, for host
//!   memory) that is not mapped when registered or unregistered — a heap unregistered after its
//!   memory went back;
//! * a region outside its heap, overlapping another region, in an unknown heap;
//! * the unregistering of a region or heap that is not registered; a malformed descriptor;
//! * the memory extension initialized before NVTX's core (`InitializeInjectionNvtx2`, whose
//!   export tables it checks and whose module slots it fills), as NVTX's own loader never does.
//!
//! With `NVTX_RECORDER_STRICT=1` the first breach aborts the process (a suite run under the
//! recorder fails where it happened). Unregistering a heap drops its regions, as the extension
//! says. A test reads the state with
//! `nvtx_recorder_report` (text, one item per line).

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::Mutex;

const MODULE_ID_MEM: u16 = 1;
const COMPAT_ID_MEM: u16 = 0x0102;
const SEGMENT_ID: usize = 1;
const SLOT_HEAP_REGISTER: usize = 0;
const SLOT_HEAP_UNREGISTER: usize = 1;
const SLOT_REGIONS_REGISTER: usize = 3;
const SLOT_REGIONS_UNREGISTER: usize = 5;
const USAGE_SUB_ALLOCATOR: u32 = 1;
const TYPE_VIRTUAL_ADDRESS: u32 = 1;
const REF_POINTER: u32 = 1;
const MESSAGE_ASCII: u32 = 1;

#[repr(C)]
struct ModuleSegment {
    segment_id: usize,
    slot_count: usize,
    function_slots: *mut isize,
}

#[repr(C)]
struct ModuleInfo {
    nvtx_version: u16,
    struct_size: u16,
    module_id: u16,
    compat_id: u16,
    segments_count: usize,
    segments: *mut ModuleSegment,
    get_export_function: *const c_void,
    ext_info: *const c_void,
}

#[repr(C)]
struct VirtualRange {
    size: usize,
    ptr: usize,
}

#[repr(C)]
struct HeapDesc {
    ext_compat_id: u16,
    struct_size: u16,
    reserved0: u32,
    usage: u32,
    mem_type: u32,
    type_specific_desc_size: usize,
    type_specific_desc: *const VirtualRange,
    category: u32,
    message_type: u32,
    message: *const c_char,
}

#[repr(C)]
struct RegionsRegisterBatch {
    ext_compat_id: u16,
    struct_size: u16,
    region_type: u32,
    heap: usize,
    region_count: usize,
    region_desc_element_size: usize,
    region_desc_elements: *const VirtualRange,
    region_handle_elements_out: *mut usize,
}

#[repr(C)]
struct RegionsUnregisterBatch {
    ext_compat_id: u16,
    struct_size: u16,
    ref_type: u32,
    ref_count: usize,
    ref_element_size: usize,
    ref_elements: *const usize,
}

struct Heap {
    base: usize,
    size: usize,
    name: String,
}

struct State {
    next_handle: usize,
    /// Heaps by handle.
    heaps: BTreeMap<usize, Heap>,
    /// Regions by start: (size, heap handle).
    regions: BTreeMap<usize, (usize, usize)>,
    errors: Vec<String>,
    /// Calls of heap register, heap unregister, regions register, regions unregister.
    calls: [u64; 4],
    check_mapped: bool,
    strict: bool,
    /// The core was initialized (`InitializeInjectionNvtx2`) and its tables were right.
    core: bool,
}

static STATE: Mutex<State> = Mutex::new(State {
    next_handle: 0x1000,
    heaps: BTreeMap::new(),
    regions: BTreeMap::new(),
    errors: Vec::new(),
    calls: [0; 4],
    check_mapped: false,
    strict: false,
    core: false,
});

fn state() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether `[base, base + size)` is mapped in this process (`msync` fails with `ENOMEM` on a
/// range with unmapped pages; the range's start is rounded down to its page).
fn mapped(base: usize, size: usize) -> bool {
    let page = rustix::param::page_size();
    let start = base & !(page - 1);
    let len = size + (base - start);
    // SAFETY: `msync` with `ASYNC` only asks the kernel about the range; nothing is accessed.
    unsafe { rustix::mm::msync(start as *mut c_void, len, rustix::mm::MsyncFlags::ASYNC).is_ok() }
}

impl State {
    fn error(&mut self, text: String) {
        if self.strict {
            // A suite run under the recorder fails at the first breach, where it happened.
            eprintln!("nvtx-recorder: {text}");
            std::process::abort();
        }
        self.errors.push(text);
    }

    fn heap_register(&mut self, desc: &HeapDesc) -> usize {
        self.calls[0] += 1;
        if desc.ext_compat_id != COMPAT_ID_MEM
            || usize::from(desc.struct_size) < std::mem::size_of::<HeapDesc>()
            || desc.usage != USAGE_SUB_ALLOCATOR
            || desc.mem_type != TYPE_VIRTUAL_ADDRESS
            || desc.type_specific_desc_size != std::mem::size_of::<VirtualRange>()
            || desc.type_specific_desc.is_null()
        {
            self.error("heap register: a malformed descriptor".into());
            return 0;
        }
        // SAFETY: checked non-null above; the caller's descriptor points at its range.
        let range = unsafe { &*desc.type_specific_desc };
        let name = if desc.message_type == MESSAGE_ASCII && !desc.message.is_null() {
            // SAFETY: an ASCII message is a NUL-terminated string the call keeps valid.
            unsafe { CStr::from_ptr(desc.message) }
                .to_string_lossy()
                .into_owned()
        } else {
            String::new()
        };
        let (base, size) = (range.ptr, range.size);
        if size == 0 {
            self.error(format!("heap register: {base:#x} has no bytes"));
        }
        let overlapping: Vec<usize> = self
            .heaps
            .values()
            .filter(|h| h.base < base + size && base < h.base + h.size)
            .map(|h| h.base)
            .collect();
        for other in overlapping {
            self.error(format!(
                "heap register: {base:#x}+{size:#x} overlaps the heap at {other:#x}"
            ));
        }
        if self.check_mapped && !mapped(base, size) {
            self.error(format!("heap register: {base:#x}+{size:#x} is not mapped"));
        }
        self.next_handle += 1;
        let handle = self.next_handle;
        self.heaps.insert(handle, Heap { base, size, name });
        handle
    }

    fn heap_unregister(&mut self, handle: usize) {
        self.calls[1] += 1;
        let Some(heap) = self.heaps.remove(&handle) else {
            self.error(format!("heap unregister: no heap {handle:#x}"));
            return;
        };
        if self.check_mapped && !mapped(heap.base, heap.size) {
            self.error(format!(
                "heap unregister: {:#x}+{:#x} ({}) went back before it was unregistered",
                heap.base, heap.size, heap.name
            ));
        }
        self.regions.retain(|_, (_, h)| *h != handle);
    }

    fn regions_register(&mut self, batch: &RegionsRegisterBatch) {
        self.calls[2] += 1;
        if batch.ext_compat_id != COMPAT_ID_MEM
            || usize::from(batch.struct_size) < std::mem::size_of::<RegionsRegisterBatch>()
            || batch.region_type != TYPE_VIRTUAL_ADDRESS
            || batch.region_desc_element_size != std::mem::size_of::<VirtualRange>()
            || (batch.region_count > 0 && batch.region_desc_elements.is_null())
        {
            self.error("regions register: a malformed batch".into());
            return;
        }
        let Some(heap) = self.heaps.get(&batch.heap) else {
            self.error(format!("regions register: no heap {:#x}", batch.heap));
            return;
        };
        let (heap_base, heap_end) = (heap.base, heap.base + heap.size);
        // SAFETY: the batch holds `region_count` ranges at `region_desc_elements` (checked
        // non-null when there are any).
        let ranges =
            unsafe { std::slice::from_raw_parts(batch.region_desc_elements, batch.region_count) };
        for (i, range) in ranges.iter().enumerate() {
            let (start, size) = (range.ptr, range.size);
            if start < heap_base || start + size > heap_end {
                self.error(format!(
                    "regions register: {start:#x}+{size:#x} is outside its heap {heap_base:#x}..{heap_end:#x}"
                ));
                continue;
            }
            let before = self.regions.range(..start + size.max(1)).next_back();
            if let Some((&other, &(other_size, _))) = before {
                if other + other_size > start {
                    self.error(format!(
                        "regions register: {start:#x}+{size:#x} overlaps the region at {other:#x}"
                    ));
                    continue;
                }
            }
            self.regions.insert(start, (size, batch.heap));
            if !batch.region_handle_elements_out.is_null() {
                // SAFETY: the caller gives room for one handle per range.
                unsafe { *batch.region_handle_elements_out.add(i) = start };
            }
        }
    }

    fn regions_unregister(&mut self, batch: &RegionsUnregisterBatch) {
        self.calls[3] += 1;
        if batch.ext_compat_id != COMPAT_ID_MEM
            || usize::from(batch.struct_size) < std::mem::size_of::<RegionsUnregisterBatch>()
            || batch.ref_type != REF_POINTER
            || batch.ref_element_size != std::mem::size_of::<usize>()
            || (batch.ref_count > 0 && batch.ref_elements.is_null())
        {
            self.error("regions unregister: a malformed batch".into());
            return;
        }
        // SAFETY: the batch holds `ref_count` pointers at `ref_elements` (checked non-null
        // when there are any).
        let refs = unsafe { std::slice::from_raw_parts(batch.ref_elements, batch.ref_count) };
        for &start in refs {
            if self.regions.remove(&start).is_none() {
                self.error(format!("regions unregister: no region at {start:#x}"));
            }
        }
    }
}

unsafe extern "C" fn heap_register(_domain: *mut c_void, desc: *const HeapDesc) -> usize {
    if desc.is_null() {
        state().error("heap register: no descriptor".into());
        return 0;
    }
    // SAFETY: NVTX's contract: a valid descriptor for the call.
    state().heap_register(unsafe { &*desc })
}

unsafe extern "C" fn heap_unregister(_domain: *mut c_void, heap: usize) {
    state().heap_unregister(heap);
}

unsafe extern "C" fn regions_register(_domain: *mut c_void, batch: *const RegionsRegisterBatch) {
    if batch.is_null() {
        state().error("regions register: no batch".into());
        return;
    }
    // SAFETY: NVTX's contract: a valid batch for the call.
    state().regions_register(unsafe { &*batch });
}

unsafe extern "C" fn regions_unregister(
    _domain: *mut c_void,
    batch: *const RegionsUnregisterBatch,
) {
    if batch.is_null() {
        state().error("regions unregister: no batch".into());
        return;
    }
    // SAFETY: NVTX's contract: a valid batch for the call.
    state().regions_unregister(unsafe { &*batch });
}

/// `NvtxExportTableCallbacks`.
#[repr(C)]
struct Callbacks {
    struct_size: usize,
    get_module_function_table:
        Option<unsafe extern "C" fn(c_int, *mut *const usize, *mut c_uint) -> c_int>,
}

/// `NvtxExportTableVersionInfo`.
#[repr(C)]
struct VersionInfo {
    struct_size: usize,
    version: u32,
    reserved0: u32,
    set_injection_nvtx_version: Option<unsafe extern "C" fn(u32)>,
}

/// `NVTX_CBID_<module>_SIZE` by module (1 core, 2 CUDA, 3 OpenCL, 4 CUDA runtime, 5 core 2,
/// 6 sync).
const MODULE_SIZES: [usize; 7] = [0, 16, 9, 15, 7, 16, 7];

/// What a filled core slot points at (never called by a client that makes no core calls).
unsafe extern "C" fn core_call() {}

/// The core's entry point, as NVTX's loader calls it before any extension: checks the export
/// tables (the callbacks' module tables of NVTX's sizes, null at both ends; the version) and
/// fills every module's slots.
///
/// # Safety
/// `get_export_table` is NVTX's `NvtxGetExportTableFunc_t`.
#[no_mangle]
pub unsafe extern "C" fn InitializeInjectionNvtx2(
    get_export_table: Option<unsafe extern "C" fn(u32) -> *const c_void>,
) -> c_int {
    let Some(get) = get_export_table else {
        state().error("core: no export table function".into());
        return 0;
    };
    // SAFETY: NVTX's contract: table 1 is the callbacks, table 3 the version information.
    let (callbacks, version) = unsafe {
        (
            get(1).cast::<Callbacks>().as_ref(),
            get(3).cast::<VersionInfo>().as_ref(),
        )
    };
    let mut problems = Vec::new();
    match version {
        Some(v) if v.struct_size == std::mem::size_of::<VersionInfo>() && v.version == 3 => {
            if let Some(set) = v.set_injection_nvtx_version {
                // SAFETY: the client's function of that type.
                unsafe { set(3) };
            }
        }
        _ => problems.push("core: a missing or malformed version table".to_owned()),
    }
    match callbacks.and_then(|c| {
        (c.struct_size == std::mem::size_of::<Callbacks>())
            .then_some(c.get_module_function_table)?
    }) {
        None => problems.push("core: a missing or malformed callbacks table".to_owned()),
        Some(get_table) => {
            for (module, &expected) in MODULE_SIZES.iter().enumerate().skip(1) {
                let (mut table, mut size): (*const usize, c_uint) = (std::ptr::null(), 0);
                // SAFETY: the client's function of that type, with room for both answers.
                let found = unsafe { get_table(module as c_int, &mut table, &mut size) };
                if found == 0 || table.is_null() || size as usize != expected {
                    problems.push(format!(
                        "core: module {module}'s table is missing or of size {size}"
                    ));
                    continue;
                }
                // SAFETY: a module table has `size + 1` entries.
                let entries = unsafe { std::slice::from_raw_parts(table, expected + 1) };
                if entries[0] != 0 || entries[expected] != 0 {
                    problems.push(format!(
                        "core: module {module}'s table is not null at its ends"
                    ));
                    continue;
                }
                for &slot in &entries[1..expected] {
                    // SAFETY: each entry points at one of the client's function slots.
                    unsafe { *(slot as *mut usize) = core_call as *const () as usize };
                }
            }
            let mut unused: (*const usize, c_uint) = (std::ptr::null(), 0);
            // SAFETY: as above; module 7 does not exist.
            if unsafe { get_table(7, &mut unused.0, &mut unused.1) } != 0 {
                problems.push("core: a table for a module NVTX does not have".to_owned());
            }
        }
    }
    let mut st = state();
    for problem in problems {
        st.error(problem);
    }
    st.core = true;
    1
}

/// The memory extension's entry point: fills the heap and region slots. Returns 0 (failure) for
/// another module or a layout it does not know.
///
/// # Safety
/// `info` is NVTX's module description, valid for the call, its slots writable.
#[no_mangle]
pub unsafe extern "C" fn InitializeInjectionNvtxExtension(info: *mut c_void) -> c_int {
    if info.is_null() {
        return 0;
    }
    // SAFETY: the caller's contract: an `nvtxExtModuleInfo_t`.
    let info = unsafe { &mut *info.cast::<ModuleInfo>() };
    if info.module_id != MODULE_ID_MEM
        || info.compat_id != COMPAT_ID_MEM
        || usize::from(info.struct_size) < std::mem::size_of::<ModuleInfo>()
        || info.segments_count != 1
        || info.segments.is_null()
    {
        return 0;
    }
    // SAFETY: one segment, checked above.
    let segment = unsafe { &mut *info.segments };
    if segment.segment_id != SEGMENT_ID
        || segment.slot_count <= SLOT_REGIONS_UNREGISTER
        || segment.function_slots.is_null()
    {
        return 0;
    }
    let on = |name: &str| std::env::var_os(name).is_some_and(|v| v == "1");
    {
        let mut st = state();
        st.check_mapped = on("NVTX_RECORDER_CHECK_MAPPED");
        st.strict = on("NVTX_RECORDER_STRICT");
        if !st.core {
            st.error("the memory extension was initialized before the core".into());
        }
    }
    let fill = |slot: usize, f: isize| {
        // SAFETY: `slot` < `slot_count`, checked above.
        unsafe { *segment.function_slots.add(slot) = f };
    };
    fill(SLOT_HEAP_REGISTER, heap_register as *const () as isize);
    fill(SLOT_HEAP_UNREGISTER, heap_unregister as *const () as isize);
    fill(
        SLOT_REGIONS_REGISTER,
        regions_register as *const () as isize,
    );
    fill(
        SLOT_REGIONS_UNREGISTER,
        regions_unregister as *const () as isize,
    );
    1
}

/// Writes the recorder's state as text into `out` (at most `capacity` bytes) and returns its
/// whole length (call again with more room when it is larger than `capacity`). One item per line:
/// `heap <base> <size> <name>`, `region <start> <size> <heap base>`, `error <text>`,
/// `calls <heap register> <heap unregister> <regions register> <regions unregister>`.
///
/// # Safety
/// `out` is valid for `capacity` bytes of writing (or `capacity` is 0).
#[no_mangle]
pub unsafe extern "C" fn nvtx_recorder_report(out: *mut u8, capacity: usize) -> usize {
    let text = {
        let st = state();
        let mut text = String::new();
        for heap in st.heaps.values() {
            text.push_str(&format!("heap {} {} {}\n", heap.base, heap.size, heap.name));
        }
        for (start, (size, handle)) in &st.regions {
            let heap = st.heaps.get(handle).map_or(0, |h| h.base);
            text.push_str(&format!("region {start} {size} {heap}\n"));
        }
        for error in &st.errors {
            text.push_str(&format!("error {error}\n"));
        }
        let c = st.calls;
        text.push_str(&format!("calls {} {} {} {}\n", c[0], c[1], c[2], c[3]));
        text
    };
    if !out.is_null() && capacity >= text.len() {
        // SAFETY: the caller's contract: `capacity` bytes at `out`, enough for the text.
        unsafe { std::ptr::copy_nonoverlapping(text.as_ptr(), out, text.len()) };
    }
    text.len()
}
