//! Size policy, PyTorch's numbers: request rounding, pool choice, segment sizes, split rules.
//!
//! | request (after rounding) | pool  | new segment size            | split remainder if |
//! |--------------------------|-------|-----------------------------|--------------------|
//! | ≤ 1 MiB                  | small | 2 MiB                       | ≥ 512 B            |
//! | 1 MiB < r < 10 MiB       | large | 20 MiB                      | > 1 MiB            |
//! | ≥ 10 MiB                 | large | r rounded up to 2 MiB       | > 1 MiB (and r < max_split_size) |
//!
//! Rounding: below 512 B → 512 B; otherwise a multiple of 512 B, or — when `roundup_power2_divisions`
//! gives d > 1 divisions for the size's interval and the size exceeds 512 × d — up to the next of d
//! equal steps between two powers of two (e.g. d = 4: 4097 → 5120, 6000 → 6144).

use crate::config::cell::FitRules;
#[cfg(test)]
use crate::config::AllocatorConfig;
use crate::error::{Error, Result};

/// Smallest block and rounding quantum.
pub(crate) const MIN_BLOCK_SIZE: u64 = 512;
/// Largest request served by the small pool.
pub(crate) const SMALL_SIZE: u64 = 1 << 20;
/// Segment size of the small pool.
pub(crate) const SMALL_BUFFER: u64 = 2 << 20;
/// Segment size for requests between 1 and 10 MiB.
pub(crate) const LARGE_BUFFER: u64 = 20 << 20;
/// Requests at least this large get a segment of their own size.
pub(crate) const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Granularity of those segments.
pub(crate) const ROUND_LARGE: u64 = 2 << 20;
/// Requests above this fail at once (1 EB): no arithmetic downstream can overflow.
pub(crate) const MAX_REQUEST: u64 = 1 << 60;

/// Which pool a block lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub(crate) enum PoolKind {
    /// Blocks of ≤ 1 MiB, carved from 2 MiB segments.
    Small,
    /// Everything else.
    Large,
}

impl PoolKind {
    /// The pool for a rounded request.
    pub(crate) fn for_size(rounded: u64) -> Self {
        if rounded <= SMALL_SIZE {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }
}

/// Checks a request against the 1 EB ceiling.
pub(crate) fn check_request(device: usize, size: u64) -> Result<()> {
    if size > MAX_REQUEST {
        return Err(Error::OutOfMemory {
            device,
            requested: size,
            message: format!(
                "tried to allocate {size} bytes, more than the 1 EB any device could hold; \
                 this request is almost certainly a size computation gone wrong"
            ),
        });
    }
    Ok(())
}

/// Rounds a request (≤ [`MAX_REQUEST`]) to a block size under `config`.
#[cfg(test)]
pub(crate) fn round_size(size: u64, config: &AllocatorConfig) -> u64 {
    round_size_by(size, |size| config.divisions_for(size))
}

/// [`round_size`] with `divisions_for` giving the `roundup_power2_divisions` entry of a size
/// (`ConfigCell::divisions_for`: one atomic load on the hot path).
#[inline]
pub(crate) fn round_size_by(size: u64, divisions_for: impl FnOnce(u64) -> u64) -> u64 {
    if size < MIN_BLOCK_SIZE {
        return MIN_BLOCK_SIZE;
    }
    let divisions = divisions_for(size);
    if divisions > 1 && size > MIN_BLOCK_SIZE * divisions {
        round_to_power2_division(size, divisions)
    } else {
        size.next_multiple_of(MIN_BLOCK_SIZE)
    }
}

/// Rounds up to the next of `divisions` equal steps between the powers of two around `size`.
fn round_to_power2_division(size: u64, divisions: u64) -> u64 {
    if size.is_power_of_two() {
        return size;
    }
    let floor = 1u64 << size.ilog2();
    let step = floor / divisions;
    if step == 0 {
        return floor << 1;
    }
    size.next_multiple_of(step)
}

/// Size of the segment to allocate for a rounded request.
pub(crate) fn segment_size(rounded: u64) -> u64 {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        rounded.next_multiple_of(ROUND_LARGE)
    }
}

/// Whether a free block of `block_size` serving `rounded` bytes is split, leaving the remainder
/// free (`expandable`: the block lies in an expandable segment).
pub(crate) fn should_split(
    pool: PoolKind,
    block_size: u64,
    rounded: u64,
    rules: FitRules,
    expandable: bool,
) -> bool {
    let remaining = block_size - rounded;
    if expandable {
        // As PyTorch: a remainder in an expandable segment is worth keeping, whatever its size —
        // its pages can be unmapped or grown into.
        return remaining >= MIN_BLOCK_SIZE;
    }
    match pool {
        PoolKind::Small => remaining >= MIN_BLOCK_SIZE,
        PoolKind::Large => rounded < rules.max_split_size && remaining > SMALL_SIZE,
    }
}

/// The oversize rules of best fit: may a free block of `block_size` serve `rounded` bytes?
pub(crate) fn fits_oversize_rules(block_size: u64, rounded: u64, rules: FitRules) -> bool {
    let max_split = rules.max_split_size;
    if max_split == u64::MAX {
        return true;
    }
    // An oversize block is never handed to a small request...
    if rounded < max_split && block_size >= max_split {
        return false;
    }
    // ...and an oversize request takes an oversize block only if it wastes less than
    // `max_non_split_rounding` (20 MiB unless set).
    !(rounded >= max_split && block_size >= rounded.saturating_add(rules.max_non_split_rounding))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_table() {
        let c = AllocatorConfig::default();
        for (size, want) in [
            (0, 512),
            (1, 512),
            (511, 512),
            (512, 512),
            (513, 1024),
            (1_000_000, 1_000_448),
        ] {
            assert_eq!(round_size(size, &c), want, "size {size}");
        }
        let p4 = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
        // At most 512 * 4 bytes: plain 512-byte rounding.
        assert_eq!(round_size(1280, &p4), 1536);
        assert_eq!(round_size(2000, &p4), 2048);
        // Above: four steps between powers of two (4096, 5120, 6144, 7168, 8192).
        assert_eq!(round_size(4096, &p4), 4096);
        assert_eq!(round_size(4097, &p4), 5120);
        assert_eq!(round_size(6000, &p4), 6144);
        assert_eq!(round_size(7169, &p4), 8192);
        assert_eq!(round_size(5 << 20 | 1, &p4), 6 << 20);
        assert_eq!(round_size(MAX_REQUEST, &p4), MAX_REQUEST);
    }

    #[test]
    fn pools_and_segment_sizes() {
        assert_eq!(PoolKind::for_size(SMALL_SIZE), PoolKind::Small);
        assert_eq!(PoolKind::for_size(SMALL_SIZE + 512), PoolKind::Large);
        assert_eq!(segment_size(512), SMALL_BUFFER);
        assert_eq!(segment_size(SMALL_SIZE + 512), LARGE_BUFFER);
        assert_eq!(segment_size(MIN_LARGE_ALLOC - 512), LARGE_BUFFER);
        assert_eq!(segment_size(MIN_LARGE_ALLOC + 512), 12 << 20);
        assert!(check_request(0, MAX_REQUEST + 1).is_err());
    }

    #[test]
    fn split_and_oversize_rules() {
        let c = AllocatorConfig::default();
        assert!(should_split(
            PoolKind::Small,
            1024,
            512,
            c.fit_rules(),
            false
        ));
        assert!(!should_split(
            PoolKind::Small,
            1024,
            1024,
            c.fit_rules(),
            false
        ));
        assert!(!should_split(
            PoolKind::Large,
            3 << 20,
            2 << 20,
            c.fit_rules(),
            false
        )); // remainder exactly 1 MiB
        assert!(should_split(
            PoolKind::Large,
            3 << 20,
            (2 << 20) - 512,
            c.fit_rules(),
            false
        ));
        let m = AllocatorConfig::parse("max_split_size_mb:40").unwrap();
        assert!(!should_split(
            PoolKind::Large,
            100 << 20,
            50 << 20,
            m.fit_rules(),
            m.expandable_segments
        ));
        assert!(!fits_oversize_rules(50 << 20, 2 << 20, m.fit_rules()));
        assert!(fits_oversize_rules(50 << 20, 45 << 20, m.fit_rules()));
        assert!(!fits_oversize_rules(70 << 20, 45 << 20, m.fit_rules()));
        assert!(fits_oversize_rules(30 << 20, 2 << 20, m.fit_rules()));
    }
}
