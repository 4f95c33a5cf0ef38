//! Device memory: allocations in regions, placed in a per-device address space that never reuses
//! an address, so a pointer into freed memory is recognized as such forever.
//!
//! | allocation state | resolving a pointer into it                          |
//! |------------------|------------------------------------------------------|
//! | live (owned)     | ok, within `[base, base + size)`                     |
//! | live (opened)    | ok; `cuMemFree` of it is a violation (close it)      |
//! | freed / closed   | violation "use after free"; queued work that runs on it faults its stream |
//! | never allocated  | violation "not device memory"                        |
//!
//! Device `d` allocates addresses from `(d + 1) << 44` upward (16 TiB each: a test process makes
//! thousands of expandable-segment reservations of twice the device's memory, none reused), each
//! allocation rounded up to 2 MiB and followed by a 2 MiB gap, so an access running past the end
//! of an allocation never lands in the next one.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::codes;
use crate::region::Region;
use crate::report::{Checked, Fail};

/// Address granularity and guard gap.
const GRANULE: u64 = 2 << 20;
/// Each device's address space is `1 << SPACE_BITS` bytes, never reused.
const SPACE_BITS: u32 = 44;

/// Where an allocation came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// `cuMemAddressReserve` in this process.
    Reserved,
    /// `cuMemAlloc` in this process; `id` names it in IPC handles.
    Owned {
        /// The number in the region header.
        id: u64,
    },
    /// `cuIpcOpenMemHandle` of another process's allocation.
    Opened {
        /// The exporter.
        pid: u32,
        /// The exporter's number for it.
        id: u64,
    },
}

/// The memory behind an allocation.
#[derive(Debug)]
pub enum Backing {
    /// A region of its own (`cuMemAlloc`, or another process's opened through IPC).
    Region(Region),
    /// A reservation (`cuMemAddressReserve`): memory only where chunks are mapped.
    Reserved(Arc<crate::vm::VmRange>),
}

impl Allocation {
    /// The reservation this allocation is, if it is one.
    pub fn reserved(&self) -> Option<&Arc<crate::vm::VmRange>> {
        match &self.backing {
            Backing::Reserved(vm) => Some(vm),
            Backing::Region(_) => None,
        }
    }
}

/// A device allocation.
#[derive(Debug)]
pub struct Allocation {
    /// Device address of the first byte.
    pub base: u64,
    /// Bytes.
    pub size: u64,
    /// Device.
    pub device: usize,
    /// The context that allocated or opened it.
    pub ctx: usize,
    /// Where it came from.
    pub origin: Origin,
    /// The memory.
    pub backing: Backing,
    /// Set by free/close: queued work that reaches it faults.
    pub released: AtomicBool,
}

impl Allocation {
    /// A host pointer to byte `offset` (queued work checks `released` first).
    pub fn at(&self, offset: u64) -> *mut u8 {
        match &self.backing {
            // SAFETY: callers pass offsets from `Memory::resolve`, inside the payload.
            Backing::Region(region) => unsafe { region.payload().add(offset as usize) },
            Backing::Reserved(vm) => vm.at(offset),
        }
    }

    /// The fault of device work reaching this allocation after it was released.
    pub fn check_live(&self, what: &str) -> Checked<()> {
        if self.released.load(Ordering::Acquire) {
            return Err(Fail::violation(
                codes::ILLEGAL_ADDRESS,
                format!(
                    "{what} ran on allocation {:#x} (+{} bytes) after it was freed or closed",
                    self.base, self.size
                ),
            ));
        }
        Ok(())
    }
}

/// Every allocation of the process.
#[derive(Debug)]
pub struct Memory {
    live: RwLock<BTreeMap<u64, Arc<Allocation>>>,
    released: Mutex<BTreeMap<u64, u64>>,
    next_address: Vec<Mutex<u64>>,
    next_id: AtomicU64,
    /// `(exporter pid, id, device)` → base, of allocations opened and not yet closed.
    pub opened: Mutex<HashMap<(u32, u64, usize), u64>>,
    /// Physical chunks by handle (`cuMemCreate`, `cuMemImportFromShareableHandle`); a released
    /// handle maps to `None`.
    pub chunks: Mutex<HashMap<u64, Option<Arc<crate::vm::PhysChunk>>>>,
}

impl Memory {
    /// Empty memory for `devices` devices.
    pub fn new(devices: usize) -> Self {
        Memory {
            live: RwLock::new(BTreeMap::new()),
            released: Mutex::new(BTreeMap::new()),
            next_address: (0..devices)
                .map(|d| Mutex::new((d as u64 + 1) << SPACE_BITS))
                .collect(),
            next_id: AtomicU64::new(1),
            opened: Mutex::new(HashMap::new()),
            chunks: Mutex::new(HashMap::new()),
        }
    }

    /// A number for a new owned allocation.
    pub fn fresh_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Reserves addresses for `size` bytes on `device`.
    pub fn place(&self, device: usize, size: u64) -> Checked<u64> {
        let oom = || Fail::outcome(codes::OUT_OF_MEMORY, "device address space exhausted");
        let slot = self.next_address.get(device).ok_or_else(oom)?;
        let mut next = slot.lock().unwrap_or_else(|p| p.into_inner());
        let base = *next;
        let span = size
            .checked_next_multiple_of(GRANULE)
            .and_then(|s| s.checked_add(GRANULE))
            .ok_or_else(oom)?;
        let end = base.checked_add(span).ok_or_else(oom)?;
        if end > (device as u64 + 2) << SPACE_BITS {
            return Err(oom());
        }
        *next = end;
        Ok(base)
    }

    /// Adds a live allocation.
    pub fn insert(&self, allocation: Arc<Allocation>) {
        self.live
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(allocation.base, allocation);
    }

    /// Removes the allocation based at `base` if `accept` approves it; marks it released.
    pub fn remove(
        &self,
        base: u64,
        accept: impl FnOnce(&Allocation) -> Checked<()>,
    ) -> Checked<Arc<Allocation>> {
        let mut live = self.live.write().unwrap_or_else(|p| p.into_inner());
        let Some(found) = live.get(&base) else {
            return Err(self.unknown(base, "is not the base of a live allocation"));
        };
        accept(found)?;
        let allocation = live
            .remove(&base)
            .ok_or_else(|| self.unknown(base, "vanished"))?;
        drop(live);
        allocation.released.store(true, Ordering::Release);
        self.released
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(base, allocation.size);
        Ok(allocation)
    }

    /// As [`Memory::resolve`], for the virtual-memory calls themselves: a reservation's range need
    /// not be mapped.
    pub fn resolve_reserved(&self, ptr: u64, len: u64) -> Checked<(Arc<Allocation>, u64)> {
        let live = self.live.read().unwrap_or_else(|p| p.into_inner());
        if let Some((_, a)) = live.range(..=ptr).next_back() {
            let offset = ptr - a.base;
            if a.reserved().is_some()
                && offset.checked_add(len).is_some_and(|e| e <= a.size)
                && offset < a.size
            {
                return Ok((a.clone(), offset));
            }
        }
        drop(live);
        Err(self.unknown(ptr, "is not inside a reservation"))
    }

    /// The allocation holding `[ptr, ptr + len)` and the offset of `ptr` in it.
    pub fn resolve(&self, ptr: u64, len: u64) -> Checked<(Arc<Allocation>, u64)> {
        let live = self.live.read().unwrap_or_else(|p| p.into_inner());
        if let Some((_, a)) = live.range(..=ptr).next_back() {
            let offset = ptr - a.base;
            if offset < a.size.max(1) {
                let end = offset.checked_add(len);
                if end.is_none_or(|e| e > a.size) {
                    return Err(Fail::violation(
                        codes::INVALID_VALUE,
                        format!(
                            "{len} bytes at {ptr:#x} run past the end of allocation {:#x} \
                             ({} bytes)",
                            a.base, a.size
                        ),
                    ));
                }
                if let Some(vm) = a.reserved() {
                    vm.check_covered(ptr, offset, len)?;
                }
                return Ok((a.clone(), offset));
            }
        }
        drop(live);
        Err(self.unknown(ptr, "is not in any live allocation"))
    }

    /// Every live allocation of the context `ctx` (to release with it).
    pub fn of_context(&self, ctx: usize) -> Vec<u64> {
        self.live
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|a| a.ctx == ctx)
            .map(|a| a.base)
            .collect()
    }

    fn unknown(&self, ptr: u64, what: &str) -> Fail {
        let released = self.released.lock().unwrap_or_else(|p| p.into_inner());
        let freed = released
            .range(..=ptr)
            .next_back()
            .filter(|(base, size)| ptr < **base + (**size).max(1));
        match freed {
            Some((base, _)) => Fail::violation(
                codes::INVALID_VALUE,
                format!("{ptr:#x} is in allocation {base:#x}, which was freed or closed (use after free)"),
            ),
            None => Fail::violation(
                codes::INVALID_VALUE,
                format!("{ptr:#x} {what}: not device memory the driver returned"),
            ),
        }
    }
}
