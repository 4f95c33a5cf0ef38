//! Range checks shared by both backends: every device address a caller passes must lie, with its
//! whole length, inside one segment the driver allocated or opened.

use std::collections::BTreeMap;

use crate::driver::DeviceAddr;
use crate::error::{Error, Result};

/// Finds the segment (keyed by base address, sized by `size_of`) that contains `[ptr, ptr + len)`.
/// A zero-length range may sit at the very end of a segment.
pub(crate) fn containing<T>(
    segments: &BTreeMap<u64, T>,
    size_of: impl Fn(&T) -> u64,
    ptr: DeviceAddr,
    len: u64,
) -> Result<(u64, &T)> {
    let unknown = || {
        Error::invalid(format!(
            "pointer {ptr} was not allocated or opened by this driver"
        ))
    };
    let (&base, seg) = segments.range(..=ptr.0).next_back().ok_or_else(unknown)?;
    let size = size_of(seg);
    let end = base.saturating_add(size);
    if ptr.0 > end || (ptr.0 == end && len > 0) {
        return Err(unknown());
    }
    let last = ptr.0.checked_add(len).ok_or_else(|| {
        Error::invalid(format!("range {ptr} + {len} overflows the address space"))
    })?;
    if last > end {
        return Err(Error::invalid(format!(
            "range {ptr} + {len} bytes runs past the end of its segment ({base:#x} + {size})"
        )));
    }
    Ok((base, seg))
}

/// The error for freeing a segment that was opened from another process's handle.
pub(crate) fn opened_not_owned(ptr: DeviceAddr) -> Error {
    Error::invalid(format!(
        "segment {ptr} was opened from another process: close it, do not free it"
    ))
}

/// The error for a pointer that is not the base of a segment this driver allocated.
pub(crate) fn not_a_segment_base(ptr: DeviceAddr) -> Error {
    Error::invalid(format!(
        "pointer {ptr} is not the base of a segment allocated by this driver"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_must_stay_inside_one_segment() {
        let map: BTreeMap<u64, u64> = [(0x1000, 0x100), (0x2000, 0x10)].into();
        let size = |s: &u64| *s;
        assert_eq!(
            containing(&map, size, DeviceAddr(0x1000), 0x100).unwrap().0,
            0x1000
        );
        assert_eq!(
            containing(&map, size, DeviceAddr(0x10ff), 1).unwrap().0,
            0x1000
        );
        assert!(containing(&map, size, DeviceAddr(0x10ff), 2).is_err());
        assert!(containing(&map, size, DeviceAddr(0x1100), 1).is_err());
        assert!(containing(&map, size, DeviceAddr(0x1100), 0).is_ok());
        assert!(containing(&map, size, DeviceAddr(0xfff), 1).is_err());
        assert!(containing(&map, size, DeviceAddr(0x2008), u64::MAX).is_err());
        assert!(containing(&map, size, DeviceAddr(0x5000), 1).is_err());
    }
}
