//! The byte patterns written and checked by the kernels (`kernels/pattern.cu`, `kernels/poison.cu`)
//! and by the host backend's native kernels. Both sides compute exactly these functions.
//!
//! The fill pattern depends only on a seed and the byte's offset *within the filled range*, not on
//! its address, so a copy of a filled buffer verifies against the same seed. Bytes are taken from
//! 64-bit words: word `w` is a splitmix64 mix of `seed + w * φ`, and byte `i` is byte `i % 8` (little
//! endian) of word `i / 8`.

/// The 64-bit golden-ratio increment of splitmix64.
pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// Word poisoned memory is filled with (little endian, repeated from the start of the range).
pub const POISON_WORD: u32 = 0xDEAD_BEEF;

/// The pattern's `word`-th 64-bit word for `seed`.
#[inline]
pub fn word(seed: u64, word: u64) -> u64 {
    let mut z = seed.wrapping_add(word.wrapping_mul(GOLDEN));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The pattern's byte at offset `index` for `seed`.
#[inline]
pub fn byte(seed: u64, index: u64) -> u8 {
    word(seed, index / 8).to_le_bytes()[(index % 8) as usize]
}

/// The poison byte at offset `index` of a poisoned range.
#[inline]
pub fn poison_byte(index: u64) -> u8 {
    POISON_WORD.to_le_bytes()[(index % 4) as usize]
}

/// Fills `out` with the pattern, `out[0]` being offset `start`.
pub fn fill(out: &mut [u8], seed: u64, start: u64) {
    for (i, b) in out.iter_mut().enumerate() {
        *b = byte(seed, start + i as u64);
    }
}

/// A buffer of `len` pattern bytes.
pub fn expected(len: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0; len];
    fill(&mut out, seed, 0);
    out
}

/// Counts bytes of `data` that differ from the pattern, `data[0]` being offset 0.
pub fn count_mismatches(data: &[u8], seed: u64) -> u64 {
    data.iter()
        .enumerate()
        .filter(|&(i, &b)| b != byte(seed, i as u64))
        .count() as u64
}

/// Counts bytes of `data` that are not poison.
pub fn count_non_poison(data: &[u8]) -> u64 {
    data.iter()
        .enumerate()
        .filter(|&(i, &b)| b != poison_byte(i as u64))
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_come_from_little_endian_words() {
        let w = word(7, 3);
        for k in 0..8 {
            assert_eq!(byte(7, 24 + k), (w >> (8 * k)) as u8);
        }
    }

    #[test]
    fn different_seeds_give_different_patterns() {
        let a = expected(4096, 1);
        let b = expected(4096, 2);
        assert!(count_mismatches(&a, 2) > 4000);
        assert_eq!(count_mismatches(&a, 1), 0);
        assert_ne!(a, b);
    }

    #[test]
    fn poison_is_deadbeef_le() {
        let bytes: Vec<u8> = (0..8).map(poison_byte).collect();
        assert_eq!(bytes, [0xEF, 0xBE, 0xAD, 0xDE, 0xEF, 0xBE, 0xAD, 0xDE]);
        assert_eq!(count_non_poison(&bytes), 0);
    }
}
