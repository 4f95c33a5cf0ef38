//! [`NixlRegistrar`]: registers each region the allocator maps with one NIXL agent, once.
//!
//! A region is registered as one NIXL descriptor (DRAM on the host backend, whose device memory is
//! real shared memory in this process; VRAM with the device's ordinal on CUDA), and its
//! registration handle is kept under the region's [`SegmentId`] until the allocator deregisters it
//! (before the memory goes) or the registrar is detached. NIXL refuses a transfer descriptor that is
//! not inside memory registered with it, so a region that failed or was deregistered is never
//! silently written.

use std::collections::HashMap;

use nixl_sys::{Agent, MemType, MemoryRegion, NixlDescriptor, RegistrationHandle};

use crate::alloc::{Region, Registrar, SegmentId};
use crate::error::{Error, Result};
use crate::sync::os::atomic::{AtomicU64, Ordering};
use crate::sync::os::Mutex;

/// One region as NIXL sees it.
#[derive(Debug)]
pub(crate) struct NixlRegion {
    pub addr: u64,
    pub len: u64,
    pub device: u64,
    pub mem_type: MemType,
}

impl MemoryRegion for NixlRegion {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len as usize
    }
}

impl NixlDescriptor for NixlRegion {
    fn mem_type(&self) -> MemType {
        self.mem_type
    }

    fn device_id(&self) -> u64 {
        self.device
    }
}

/// NIXL said no (its error is kept as the registration error's source).
#[derive(Debug, thiserror::Error)]
#[error("NIXL refused to register {len} bytes at {addr:#x}: {cause}")]
pub(crate) struct NixlRefused {
    addr: u64,
    len: u64,
    cause: nixl_sys::NixlError,
}

/// Registers every region of an allocator with one NIXL agent (see the module docs).
pub(crate) struct NixlRegistrar {
    agent: Agent,
    mem_type: MemType,
    handles: Mutex<HashMap<SegmentId, RegistrationHandle>>,
    /// Bumped by every registration and deregistration: metadata read at generation `g` knows
    /// every region registered up to `g`.
    generation: AtomicU64,
}

impl std::fmt::Debug for NixlRegistrar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlRegistrar")
            .field("mem_type", &self.mem_type)
            .field("registered", &self.handles.lock().len())
            .finish()
    }
}

impl NixlRegistrar {
    pub(crate) fn new(agent: Agent, mem_type: MemType) -> Self {
        NixlRegistrar {
            agent,
            mem_type,
            handles: Mutex::new(HashMap::new()),
            generation: AtomicU64::new(0),
        }
    }

    /// The registration generation (see the field).
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The NIXL descriptor of `len` bytes at `addr` on `device`, in this registrar's memory type.
    pub(crate) fn region(&self, addr: u64, len: u64, device: usize) -> NixlRegion {
        NixlRegion {
            addr,
            len,
            device: self.device_id(device),
            mem_type: self.mem_type,
        }
    }

    /// NIXL's device id: the device ordinal for VRAM, 0 for DRAM.
    pub(crate) fn device_id(&self, device: usize) -> u64 {
        match self.mem_type {
            MemType::Vram => device as u64,
            _ => 0,
        }
    }

    pub(crate) fn mem_type(&self) -> MemType {
        self.mem_type
    }

    /// Whether region `id` is registered with this agent.
    pub(crate) fn holds(&self, id: SegmentId) -> bool {
        self.handles.lock().contains_key(&id)
    }

    /// Regions registered now.
    pub(crate) fn registered(&self) -> usize {
        self.handles.lock().len()
    }
}

impl Registrar for NixlRegistrar {
    fn name(&self) -> &str {
        "nixl"
    }

    fn register(&self, region: &Region) -> Result<()> {
        let descriptor = self.region(region.base.0, region.size, region.device);
        let handle = self
            .agent
            .register_memory(&descriptor, None)
            .map_err(|cause| {
                Error::registration(
                    "nixl",
                    NixlRefused {
                        addr: region.base.0,
                        len: region.size,
                        cause,
                    },
                )
            })?;
        self.handles.lock().insert(region.id, handle);
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    fn deregister(&self, region: &Region) {
        let handle = self.handles.lock().remove(&region.id);
        self.generation.fetch_add(1, Ordering::AcqRel);
        if let Some(mut handle) = handle {
            if let Err(err) = handle.deregister() {
                tracing::error!(%err, region = %region.id, "NIXL deregistration failed");
            }
        }
    }
}
