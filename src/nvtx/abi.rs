//! The C layout of NVTX v3's memory extension (`nvToolsExtMem.h`, extension-loading types of
//! `nvtxExtTypes.h`), as far as cudalloc calls it: written from the published headers' layouts,
//! for 64-bit targets (every `size_t` a `usize`, every pointer a pointer).
//!
//! Only what heaps and regions of virtual addresses need is here: permissions, resizing, naming of
//! regions and the CUDA-runtime helpers (slots 4 and 6 onwards) are not called.

use std::ffi::{c_char, c_int, c_void};

/// `NVTX_VERSION` of the headers this layout follows.
pub(super) const NVTX_VERSION: u16 = 3;
/// `NVTX_EXT_MODULEID_MEM`: the memory extension's module.
pub(super) const MODULE_ID_MEM: u16 = 1;
/// `NVTX_EXT_COMPATID_MEM`: the layout version of the memory extension's structures.
pub(super) const COMPAT_ID_MEM: u16 = 0x0102;
/// The memory extension's one segment of function slots, and its slot count.
pub(super) const SEGMENT_ID: usize = 1;
pub(super) const SLOT_COUNT: usize = 63;

/// Function slots (`NVTX3EXT_CBID_*`).
pub(super) const SLOT_HEAP_REGISTER: usize = 0;
pub(super) const SLOT_HEAP_UNREGISTER: usize = 1;
pub(super) const SLOT_REGIONS_REGISTER: usize = 3;
pub(super) const SLOT_REGIONS_UNREGISTER: usize = 5;

/// `NVTX_EXTENSION_FRESH` / `NVTX_EXTENSION_DISABLED`: a slot no tool filled.
pub(super) const SLOT_FRESH: isize = 0;
pub(super) const SLOT_DISABLED: isize = 1;

/// `NVTX_MEM_HEAP_USAGE_TYPE_SUB_ALLOCATOR`: the heap is sub-allocated by regions.
pub(super) const HEAP_USAGE_SUB_ALLOCATOR: u32 = 0x1;
/// `NVTX_MEM_TYPE_VIRTUAL_ADDRESS`.
pub(super) const MEM_TYPE_VIRTUAL_ADDRESS: u32 = 0x1;
/// `NVTX_MEM_REGION_REF_TYPE_POINTER`: regions named by their start.
pub(super) const REGION_REF_POINTER: u32 = 0x1;
/// `NVTX_MESSAGE_TYPE_ASCII`.
pub(super) const MESSAGE_ASCII: u32 = 1;

/// `nvtxExtModuleSegment_t`.
#[repr(C)]
pub(super) struct ModuleSegment {
    pub segment_id: usize,
    pub slot_count: usize,
    pub function_slots: *mut isize,
}

/// `nvtxExtModuleInfo_t`.
#[repr(C)]
pub(super) struct ModuleInfo {
    pub nvtx_version: u16,
    pub struct_size: u16,
    pub module_id: u16,
    pub compat_id: u16,
    pub segments_count: usize,
    pub segments: *mut ModuleSegment,
    /// `NvtxExtGetExportFunction_t`: none (the memory extension needs none).
    pub get_export_function: *const c_void,
    pub ext_info: *const c_void,
}

/// `NvtxExtInitializeInjectionFunc_t`: the tool's entry point; 0 is failure.
pub(super) type InitializeInjection = unsafe extern "C" fn(*mut ModuleInfo) -> c_int;

/// `nvtxMemVirtualRangeDesc_v1`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct VirtualRange {
    pub size: usize,
    pub ptr: *const c_void,
}

/// `nvtxMemHeapDesc_v1` (the message is `nvtxMessageValue_t`, a pointer-sized union; only its
/// ASCII member is used).
#[repr(C)]
pub(super) struct HeapDesc {
    pub ext_compat_id: u16,
    pub struct_size: u16,
    pub reserved0: u32,
    pub usage: u32,
    pub mem_type: u32,
    pub type_specific_desc_size: usize,
    pub type_specific_desc: *const c_void,
    pub category: u32,
    pub message_type: u32,
    pub message: *const c_char,
}

/// `nvtxMemRegionsRegisterBatch_v1`.
#[repr(C)]
pub(super) struct RegionsRegisterBatch {
    pub ext_compat_id: u16,
    pub struct_size: u16,
    pub region_type: u32,
    pub heap: *mut c_void,
    pub region_count: usize,
    pub region_desc_element_size: usize,
    pub region_desc_elements: *const c_void,
    pub region_handle_elements_out: *mut *mut c_void,
}

/// `nvtxMemRegionsUnregisterBatch_v1` (each reference a `nvtxMemRegionRef_t`, a pointer-sized
/// union; only its pointer member is used).
#[repr(C)]
pub(super) struct RegionsUnregisterBatch {
    pub ext_compat_id: u16,
    pub struct_size: u16,
    pub ref_type: u32,
    pub ref_count: usize,
    pub ref_element_size: usize,
    pub ref_elements: *const *const c_void,
}

/// `nvtxMemHeapRegister`.
pub(super) type HeapRegister = unsafe extern "C" fn(*mut c_void, *const HeapDesc) -> *mut c_void;
/// `nvtxMemHeapUnregister`.
pub(super) type HeapUnregister = unsafe extern "C" fn(*mut c_void, *mut c_void);
/// `nvtxMemRegionsRegister`.
pub(super) type RegionsRegister = unsafe extern "C" fn(*mut c_void, *const RegionsRegisterBatch);
/// `nvtxMemRegionsUnregister`.
pub(super) type RegionsUnregister =
    unsafe extern "C" fn(*mut c_void, *const RegionsUnregisterBatch);

/// The size of `T` as the `u16` a structure's `structSize` field holds.
pub(super) const fn struct_size<T>() -> u16 {
    let size = std::mem::size_of::<T>();
    assert!(size <= u16::MAX as usize);
    size as u16
}
