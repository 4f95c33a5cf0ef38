//! The little-endian byte codec and the checksum shared by every fixed-layout encoding of the
//! crate: the IPC wire handle (`ipc/wire.rs`) and the host backend's 64-byte handles
//! (`driver/host/handle.rs`). Readers never panic: every read is bounds-checked and a short buffer
//! reads as zero (callers check lengths first and reject what they must).

/// A 64-bit mix (SplitMix64's finalizer over `seed + index·golden`).
fn mix(seed: u64, index: u64) -> u64 {
    let mut z = seed.wrapping_add(index.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Checksum of `bytes` under `seed` (each encoding uses its own seed).
pub(crate) fn checksum(seed: u64, bytes: &[u8]) -> u64 {
    bytes.chunks(8).enumerate().fold(seed, |acc, (i, chunk)| {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        mix(acc ^ u64::from_le_bytes(w), i as u64)
    })
}

fn array<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    if let Some(src) = at.checked_add(N).and_then(|end| bytes.get(at..end)) {
        out.copy_from_slice(src);
    }
    out
}

/// The little-endian `u16` at `at` (0 past the end).
pub(crate) fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(array(bytes, at))
}

/// The little-endian `u32` at `at` (0 past the end).
pub(crate) fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(array(bytes, at))
}

/// The little-endian `u64` at `at` (0 past the end).
pub(crate) fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(array(bytes, at))
}

/// Writes `value` little endian at `at` (nothing past the end).
pub(crate) fn put(bytes: &mut [u8], at: usize, value: &[u8]) {
    if let Some(dst) = at
        .checked_add(value.len())
        .and_then(|end| bytes.get_mut(at..end))
    {
        dst.copy_from_slice(value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_write_back_and_short_buffers_read_zero() {
        let mut b = [0u8; 16];
        put(&mut b, 2, &0xABCDu16.to_le_bytes());
        put(&mut b, 4, &0x0102_0304u32.to_le_bytes());
        put(&mut b, 8, &u64::MAX.to_le_bytes());
        put(&mut b, 12, &[1; 8]); // past the end: nothing written
        assert_eq!(u16_at(&b, 2), 0xABCD);
        assert_eq!(u32_at(&b, 4), 0x0102_0304);
        assert_eq!(u64_at(&b, 8), u64::MAX);
        assert_eq!(u64_at(&b, 12), 0);
        assert_eq!(u64_at(&b, usize::MAX), 0);
        assert_ne!(checksum(1, &b), checksum(2, &b));
    }
}
