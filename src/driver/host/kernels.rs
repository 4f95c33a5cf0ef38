//! The host backend's native versions of `kernels/*.cu`, plus its copy and memset.
//!
//! They run on a stream's worker thread over raw addresses inside mapped segments. The driver only
//! enqueues them after checking that every range lies inside a live segment, and a segment is only
//! unmapped after every stream has drained (see `segments.rs`), so each range stays mapped for the
//! whole call. Memory is never viewed as a Rust slice: it is shared with other processes and with
//! other streams, so it is copied through small local buffers with raw pointer copies. Like device
//! memory, bytes written concurrently by unsynchronized streams or processes are unspecified.

use std::ptr;

use crate::driver::pattern;

/// Bytes processed per step (a multiple of 8, so chunks start on pattern-word boundaries).
const CHUNK: usize = 16 * 1024;

/// Writes the fill pattern for `seed` over `len` bytes at `dst`.
///
/// # Safety
/// `[dst, dst + len)` must be mapped writable memory for the whole call.
pub(crate) unsafe fn fill_pattern(dst: usize, len: usize, seed: u64) {
    let mut buf = vec![0u8; CHUNK.min(len)];
    let mut done = 0;
    while done < len {
        let n = CHUNK.min(len - done);
        pattern::fill(&mut buf[..n], seed, done as u64);
        // SAFETY: `dst + done .. + n` is inside the caller's mapped range; `buf` is a separate
        // heap allocation, so the ranges do not overlap.
        unsafe { ptr::copy_nonoverlapping(buf.as_ptr(), (dst + done) as *mut u8, n) };
        done += n;
    }
}

/// Counts bytes of `[src, src + len)` that differ from the pattern for `seed`.
///
/// # Safety
/// `[src, src + len)` must be mapped readable memory for the whole call.
pub(crate) unsafe fn count_mismatches(src: usize, len: usize, seed: u64) -> u64 {
    let mut buf = vec![0u8; CHUNK.min(len)];
    let mut expected = vec![0u8; CHUNK.min(len)];
    let mut done = 0;
    let mut mismatches = 0;
    while done < len {
        let n = CHUNK.min(len - done);
        // SAFETY: as above; `buf` is a separate allocation of at least `n` bytes.
        unsafe { ptr::copy_nonoverlapping((src + done) as *const u8, buf.as_mut_ptr(), n) };
        pattern::fill(&mut expected[..n], seed, done as u64);
        mismatches += buf[..n]
            .iter()
            .zip(&expected[..n])
            .filter(|(a, b)| a != b)
            .count() as u64;
        done += n;
    }
    mismatches
}

/// Writes the poison pattern over `len` bytes at `dst`.
///
/// # Safety
/// `[dst, dst + len)` must be mapped writable memory for the whole call.
pub(crate) unsafe fn poison(dst: usize, len: usize) {
    let buf: Vec<u8> = (0..CHUNK.min(len) as u64)
        .map(pattern::poison_byte)
        .collect();
    let mut done = 0;
    while done < len {
        let n = CHUNK.min(len - done);
        // SAFETY: inside the caller's range; CHUNK is a multiple of 4, so every chunk starts at
        // poison phase 0, matching `pattern::poison_byte(done + i)`.
        unsafe { ptr::copy_nonoverlapping(buf.as_ptr(), (dst + done) as *mut u8, n) };
        done += n;
    }
}

/// Copies `len` bytes from `src` to `dst` (the ranges may overlap, like `cuMemcpy`'s undefined
/// overlap case made defined).
///
/// # Safety
/// Both ranges must be mapped for the whole call, `dst`'s writable.
pub(crate) unsafe fn copy(dst: usize, src: usize, len: usize) {
    // SAFETY: guaranteed by the caller; `ptr::copy` tolerates overlap.
    unsafe { ptr::copy(src as *const u8, dst as *mut u8, len) };
}

/// Sets `len` bytes at `dst` to `value`.
///
/// # Safety
/// `[dst, dst + len)` must be mapped writable memory for the whole call.
pub(crate) unsafe fn memset(dst: usize, value: u8, len: usize) {
    // SAFETY: guaranteed by the caller.
    unsafe { ptr::write_bytes(dst as *mut u8, value, len) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_and_count_agree_with_the_reference_pattern_across_chunks() {
        let len = CHUNK * 2 + 13;
        let mut mem = vec![0u8; len];
        let addr = mem.as_mut_ptr() as usize;
        // SAFETY: `mem` is a live allocation of `len` bytes, not otherwise borrowed during the calls.
        unsafe { fill_pattern(addr, len, 99) };
        assert_eq!(mem, pattern::expected(len, 99));
        mem[CHUNK + 5] ^= 0xff;
        // SAFETY: as above.
        assert_eq!(unsafe { count_mismatches(addr, len, 99) }, 1);
        // SAFETY: as above.
        unsafe { poison(addr, len) };
        assert_eq!(pattern::count_non_poison(&mem), 0);
    }
}
