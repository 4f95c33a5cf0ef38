//! The address reservations of one driver and the chunks mapped in them — the bookkeeping both
//! backends' virtual-memory API shares (`C` is what a backend keeps per mapped chunk).
//!
//! | place in a reservation | `map` there          | device work on it | `unmap`                     |
//! |------------------------|----------------------|-------------------|-----------------------------|
//! | unmapped               | ok (aligned, fits)   | refused           | refused                     |
//! | mapped                 | refused (overlap)    | ok, across adjacent chunks | ok for whole chunks |
//! | being unmapped         | refused              | refused           | refused                     |
//!
//! "Being unmapped" covers the time between taking the mappings out (no new work can name them)
//! and the backend's real unmap after draining its streams: a `map` cannot slip into that gap.
//! A reservation is freed only when nothing in it is mapped or being unmapped.

use std::collections::BTreeMap;

use crate::driver::DeviceAddr;
use crate::error::{Error, Result};

/// One reservation.
#[derive(Debug)]
pub(crate) struct VmReservation<C> {
    /// Its device.
    pub device: usize,
    /// Bytes reserved.
    pub size: u64,
    /// Mapped chunks by address: (length, backend data).
    mapped: BTreeMap<u64, (u64, C)>,
    /// Ranges being unmapped: (address, length).
    busy: Vec<(u64, u64)>,
}

/// Every reservation of a driver, by base address.
#[derive(Debug)]
pub(crate) struct VmSpace<C> {
    reservations: BTreeMap<u64, VmReservation<C>>,
}

impl<C> Default for VmSpace<C> {
    fn default() -> Self {
        VmSpace {
            reservations: BTreeMap::new(),
        }
    }
}

fn overlaps(a: u64, a_len: u64, b: u64, b_len: u64) -> bool {
    a < b.saturating_add(b_len) && b < a.saturating_add(a_len)
}

impl<C> VmSpace<C> {
    /// Records a new reservation.
    pub(crate) fn insert(&mut self, base: u64, device: usize, size: u64) {
        self.reservations.insert(
            base,
            VmReservation {
                device,
                size,
                mapped: BTreeMap::new(),
                busy: Vec::new(),
            },
        );
    }

    /// The reservation holding `[addr, addr + len)`, with its base.
    fn holding(&self, addr: u64, len: u64) -> Result<(u64, &VmReservation<C>)> {
        self.find(addr, len).ok_or_else(|| {
            Error::invalid(format!(
                "{len} bytes at {} are not inside a reservation of this driver",
                DeviceAddr(addr)
            ))
        })
    }

    /// As [`Self::holding`], without an error to build (every range check of a plain segment
    /// asks first whether a reservation holds it: `contains`).
    fn find(&self, addr: u64, len: u64) -> Option<(u64, &VmReservation<C>)> {
        self.reservations
            .range(..=addr)
            .next_back()
            .filter(|(&b, r)| {
                addr.checked_add(len)
                    .is_some_and(|end| end <= b.saturating_add(r.size))
            })
            .map(|(&b, r)| (b, r))
    }

    /// The device of the reservation holding `addr`.
    pub(crate) fn device_of(&self, addr: u64) -> Result<usize> {
        Ok(self.holding(addr, 0)?.1.device)
    }

    /// Whether the range `[addr, addr + len)` belongs to the reservations (range checks then use
    /// [`VmSpace::covered`]) rather than to a plain segment: its first byte lies inside one. An
    /// address equal to a reservation's end belongs to whatever follows — the operating system
    /// and the simulator may place a plain segment right there — except for an empty range, which
    /// may end a reservation's last block.
    pub(crate) fn contains(&self, addr: u64, len: u64) -> bool {
        self.find(addr, len.min(1)).is_some()
    }

    /// Checks that `chunk_len` bytes may be mapped at `addr` (aligned to `granularity`, inside a
    /// reservation, over nothing mapped or being unmapped); returns the reservation's device.
    pub(crate) fn check_map(&self, addr: u64, chunk_len: u64, granularity: u64) -> Result<usize> {
        let (base, r) = self.holding(addr, chunk_len)?;
        if !(addr - base).is_multiple_of(granularity) || !chunk_len.is_multiple_of(granularity) {
            return Err(Error::invalid(format!(
                "mapping {chunk_len} bytes at {}: offset and size must be multiples of the \
                 granularity ({granularity} bytes)",
                DeviceAddr(addr)
            )));
        }
        let clash = r
            .mapped
            .range(..addr.saturating_add(chunk_len))
            .next_back()
            .is_some_and(|(&at, (len, _))| overlaps(at, *len, addr, chunk_len))
            || r.busy
                .iter()
                .any(|&(at, len)| overlaps(at, len, addr, chunk_len));
        if clash {
            return Err(Error::invalid(format!(
                "{chunk_len} bytes at {} overlap memory already mapped there",
                DeviceAddr(addr)
            )));
        }
        Ok(r.device)
    }

    /// Records a mapping checked with [`VmSpace::check_map`].
    pub(crate) fn insert_mapping(&mut self, addr: u64, len: u64, chunk: C) -> Result<()> {
        let base = self.holding(addr, len)?.0;
        if let Some(r) = self.reservations.get_mut(&base) {
            r.mapped.insert(addr, (len, chunk));
        }
        Ok(())
    }

    /// Takes out the mappings of `[addr, addr + len)`, which must be whole mapped chunks, and
    /// marks the range busy until [`VmSpace::finish_unmap`].
    pub(crate) fn take_mappings(&mut self, addr: u64, len: u64) -> Result<Vec<(u64, u64, C)>> {
        let base = self.holding(addr, len)?.0;
        let r = self
            .reservations
            .get_mut(&base)
            .ok_or_else(|| Error::invalid("reservation vanished"))?;
        let end = addr.saturating_add(len);
        let mut at = addr;
        let mut keys = Vec::new();
        while at < end {
            match r.mapped.get(&at) {
                Some((chunk_len, _)) => {
                    keys.push(at);
                    at += chunk_len;
                }
                None => {
                    return Err(Error::invalid(format!(
                        "unmapping {len} bytes at {}: {} is not the start of a mapped chunk",
                        DeviceAddr(addr),
                        DeviceAddr(at)
                    )))
                }
            }
        }
        if at != end {
            return Err(Error::invalid(format!(
                "unmapping {len} bytes at {} would cut a mapped chunk",
                DeviceAddr(addr)
            )));
        }
        r.busy.push((addr, len));
        Ok(keys
            .into_iter()
            .filter_map(|k| r.mapped.remove(&k).map(|(l, c)| (k, l, c)))
            .collect())
    }

    /// Ends the unmap of `[addr, addr + len)` begun by [`VmSpace::take_mappings`].
    pub(crate) fn finish_unmap(&mut self, addr: u64, len: u64) {
        if let Ok((base, _)) = self.holding(addr, len) {
            if let Some(r) = self.reservations.get_mut(&base) {
                r.busy.retain(|&b| b != (addr, len));
            }
        }
    }

    /// Removes the reservation based at `base`, which must have nothing mapped.
    pub(crate) fn remove(&mut self, base: u64) -> Result<VmReservation<C>> {
        match self.reservations.get(&base) {
            None => Err(Error::invalid(format!(
                "{} is not the base of a reservation of this driver",
                DeviceAddr(base)
            ))),
            Some(r) if !r.mapped.is_empty() || !r.busy.is_empty() => Err(Error::invalid(format!(
                "the reservation at {} still has {} chunk(s) mapped: unmap them first",
                DeviceAddr(base),
                r.mapped.len()
            ))),
            Some(_) => self
                .reservations
                .remove(&base)
                .ok_or_else(|| Error::invalid("reservation vanished")),
        }
    }

    /// Checks that `[ptr, ptr + len)` is mapped throughout (across adjacent chunks).
    pub(crate) fn covered(&self, ptr: DeviceAddr, len: u64) -> Result<()> {
        let (_, r) = self.holding(ptr.0, len)?;
        if len == 0 {
            return Ok(()); // touches nothing, mapped or not
        }
        let end = ptr.0 + len;
        let unmapped = |at: u64| {
            Error::invalid(format!(
                "range {ptr} + {len} bytes touches {} of a reservation, which is not mapped",
                DeviceAddr(at)
            ))
        };
        let mut at = ptr.0;
        loop {
            let (&start, (chunk_len, _)) = r
                .mapped
                .range(..=at)
                .next_back()
                .ok_or_else(|| unmapped(at))?;
            let chunk_end = start + chunk_len;
            if at > chunk_end || (at == chunk_end && at < end) {
                return Err(unmapped(at));
            }
            if chunk_end >= end {
                return Ok(());
            }
            at = chunk_end;
        }
    }

    /// Every reservation's mapped chunks, drained (driver teardown).
    pub(crate) fn drain(&mut self) -> Vec<C> {
        std::mem::take(&mut self.reservations)
            .into_values()
            .flat_map(|r| r.mapped.into_values().map(|(_, c)| c))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn space() -> VmSpace<&'static str> {
        let mut s = VmSpace::default();
        s.insert(0x10000, 0, 0x8000);
        s
    }

    #[test]
    fn maps_must_be_aligned_inside_and_not_overlap() {
        let mut s = space();
        assert!(s.check_map(0x10000, 0x2000, 0x2000).is_ok());
        s.insert_mapping(0x10000, 0x2000, "a").unwrap_or_default();
        assert!(s.check_map(0x10000, 0x2000, 0x2000).is_err(), "overlap");
        assert!(s.check_map(0x11000, 0x2000, 0x2000).is_err(), "misaligned");
        assert!(
            s.check_map(0x16000, 0x4000, 0x2000).is_err(),
            "runs past the end"
        );
        assert!(
            s.check_map(0x20000, 0x2000, 0x2000).is_err(),
            "no reservation"
        );
        assert!(s.check_map(0x12000, 0x2000, 0x2000).is_ok());
    }

    #[test]
    fn an_address_at_a_reservations_end_belongs_to_what_follows() {
        let s = space();
        assert!(s.contains(0x10000, 1));
        assert!(s.contains(0x17fff, 1));
        assert!(!s.contains(0x18000, 0x2000), "a segment placed right after");
        assert!(
            s.contains(0x18000, 0),
            "an empty range ending the last block"
        );
        assert!(!s.contains(0xffff, 1));
    }

    #[test]
    fn ranges_are_covered_across_adjacent_chunks_only() {
        let mut s = space();
        s.insert_mapping(0x10000, 0x2000, "a").unwrap_or_default();
        s.insert_mapping(0x12000, 0x2000, "b").unwrap_or_default();
        s.insert_mapping(0x16000, 0x2000, "c").unwrap_or_default();
        assert!(
            s.covered(DeviceAddr(0x11000), 0x2000).is_ok(),
            "spans a and b"
        );
        assert!(s.covered(DeviceAddr(0x10000), 0x4000).is_ok());
        assert!(
            s.covered(DeviceAddr(0x13000), 0x2000).is_err(),
            "the hole after b"
        );
        assert!(s.covered(DeviceAddr(0x14000), 1).is_err());
        assert!(
            s.covered(DeviceAddr(0x17fff), 2).is_err(),
            "past the reservation"
        );
        // Unmap whole chunks only, and nothing maps over a range being unmapped.
        assert!(s.take_mappings(0x11000, 0x2000).is_err());
        let taken = s.take_mappings(0x10000, 0x4000).unwrap_or_default();
        assert_eq!(taken.len(), 2);
        assert!(s.check_map(0x10000, 0x2000, 0x2000).is_err(), "busy");
        assert!(s.covered(DeviceAddr(0x10000), 1).is_err());
        s.finish_unmap(0x10000, 0x4000);
        assert!(s.check_map(0x10000, 0x2000, 0x2000).is_ok());
        assert!(s.remove(0x10000).is_err(), "c is still mapped");
        s.take_mappings(0x16000, 0x2000).unwrap_or_default();
        s.finish_unmap(0x16000, 0x2000);
        assert!(s.remove(0x10000).is_ok());
    }
}
