//! Native implementations of the kernels in `kernels/*.cu`, with the same effect as the CUDA
//! source (grid-stride loops cover the whole range whatever the grid, so the effect does not
//! depend on the launch configuration):
//!
//! | kernel                      | parameters (PTX)               | effect                        |
//! |-----------------------------|--------------------------------|-------------------------------|
//! | `cudalloc_fill_pattern`     | dst, len, seed                 | byte i = byte i%8 of word(seed, i/8) |
//! | `cudalloc_count_mismatches` | src, len, seed, counter        | `*counter += ` bytes differing (atomic, counter 8-aligned) |
//! | `cudalloc_poison`           | dst, len                       | byte i = byte i%4 of 0xDEADBEEF (LE) |
//! | `cudalloc_sleep`            | nanos                          | the stream is busy that long  |
//!
//! Every pointer is resolved when the kernel is launched (an address outside live device memory
//! is a violation then) and checked again when the work runs (memory freed in between faults the
//! stream). `word` is the splitmix64 mix the `.cu` source defines, re-implemented here from it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::codes;
use crate::memory::Memory;
use crate::report::{Checked, Fail};

/// Work a launch queues.
pub type Work = Box<dyn FnOnce() -> Checked<()> + Send>;

/// A native kernel.
#[derive(Debug)]
pub struct Native {
    /// The PTX entry name.
    pub name: &'static str,
    /// Parameter sizes it expects.
    pub params: &'static [usize],
    /// Builds the work from the parameter values (each zero-extended to u64).
    pub build: fn(&Memory, &[u64]) -> Checked<Work>,
    /// The device ranges the kernel touches, from the same values.
    pub ranges: fn(&[u64]) -> Vec<(u64, u64)>,
}

fn first_range(args: &[u64]) -> Vec<(u64, u64)> {
    match args {
        [ptr, len, ..] => vec![(*ptr, *len)],
        _ => Vec::new(),
    }
}

fn count_ranges(args: &[u64]) -> Vec<(u64, u64)> {
    match args {
        [src, len, _, counter] => vec![(*src, *len), (*counter, 8)],
        _ => Vec::new(),
    }
}

const NATIVES: &[Native] = &[
    Native {
        name: "cudalloc_fill_pattern",
        params: &[8, 8, 8],
        build: fill_pattern,
        ranges: first_range,
    },
    Native {
        name: "cudalloc_count_mismatches",
        params: &[8, 8, 8, 8],
        build: count_mismatches,
        ranges: count_ranges,
    },
    Native {
        name: "cudalloc_poison",
        params: &[8, 8],
        build: poison,
        ranges: first_range,
    },
    Native {
        name: "cudalloc_sleep",
        params: &[8],
        build: sleep,
        ranges: |_| Vec::new(),
    },
];

/// The native implementation of kernel `name`.
pub fn native(name: &str) -> Option<&'static Native> {
    NATIVES.iter().find(|n| n.name == name)
}

/// The pattern word of `kernels/pattern.cu`.
pub fn pattern_word(seed: u64, word: u64) -> u64 {
    let mut z = seed.wrapping_add(word.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn pattern_byte(seed: u64, i: u64) -> u8 {
    (pattern_word(seed, i / 8) >> (8 * (i % 8))) as u8
}

fn fill_pattern(memory: &Memory, args: &[u64]) -> Checked<Work> {
    let &[dst, len, seed] = args else {
        return Err(arity());
    };
    let (alloc, offset) = memory.resolve(dst, len)?;
    Ok(Box::new(move || {
        alloc.check_live("cudalloc_fill_pattern")?;
        let base = alloc.at(offset);
        for i in 0..len {
            // SAFETY: `[offset, offset + len)` lies in the live allocation (resolved at launch,
            // checked live now); the region stays mapped while `alloc` is held.
            unsafe { base.add(i as usize).write_volatile(pattern_byte(seed, i)) };
        }
        Ok(())
    }))
}

fn count_mismatches(memory: &Memory, args: &[u64]) -> Checked<Work> {
    let &[src, len, seed, counter] = args else {
        return Err(arity());
    };
    let (alloc, offset) = memory.resolve(src, len)?;
    let (counter_alloc, counter_offset) = memory.resolve(counter, 8)?;
    if counter % 8 != 0 {
        return Err(Fail::violation(
            codes::ILLEGAL_ADDRESS,
            format!("atomicAdd on misaligned address {counter:#x}"),
        ));
    }
    Ok(Box::new(move || {
        alloc.check_live("cudalloc_count_mismatches")?;
        counter_alloc.check_live("cudalloc_count_mismatches (counter)")?;
        let base = alloc.at(offset);
        let mut differing = 0u64;
        for i in 0..len {
            // SAFETY: inside the live allocation, as in fill_pattern.
            let byte = unsafe { base.add(i as usize).read_volatile() };
            differing += u64::from(byte != pattern_byte(seed, i));
        }
        // SAFETY: the counter is 8 bytes inside a live, mapped allocation, 8-aligned (device
        // addresses and mapping offsets share alignment: payloads are page-aligned).
        let cell = unsafe { AtomicU64::from_ptr(counter_alloc.at(counter_offset).cast()) };
        cell.fetch_add(differing, Ordering::AcqRel);
        Ok(())
    }))
}

fn poison(memory: &Memory, args: &[u64]) -> Checked<Work> {
    let &[dst, len] = args else {
        return Err(arity());
    };
    let (alloc, offset) = memory.resolve(dst, len)?;
    Ok(Box::new(move || {
        alloc.check_live("cudalloc_poison")?;
        let base = alloc.at(offset);
        for i in 0..len {
            let byte = (0xDEAD_BEEFu32 >> (8 * (i % 4))) as u8;
            // SAFETY: inside the live allocation, as in fill_pattern.
            unsafe { base.add(i as usize).write_volatile(byte) };
        }
        Ok(())
    }))
}

fn sleep(_memory: &Memory, args: &[u64]) -> Checked<Work> {
    let &[nanos] = args else {
        return Err(arity());
    };
    Ok(Box::new(move || {
        std::thread::sleep(Duration::from_nanos(nanos.min(60_000_000_000)));
        Ok(())
    }))
}

fn arity() -> Fail {
    Fail::violation(codes::INVALID_VALUE, "wrong number of kernel parameters")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_word_matches_the_splitmix64_reference_values() {
        // splitmix64 with state 0 produces 0xE220A8397B1DCDAF as its first output.
        assert_eq!(pattern_word(0, 1), 0xE220_A839_7B1D_CDAF);
        assert_ne!(pattern_word(1, 0), pattern_word(2, 0));
    }
}
