// Fill and verify kernels for cudalloc. Byte i of a range filled with `seed` is byte (i % 8), little
// endian, of pattern_word(seed, i / 8): a splitmix64 mix of seed + word * golden ratio. The host
// backend computes the same function (src/driver/pattern.rs); tests compare the two.

__device__ __forceinline__ unsigned long long cudalloc_pattern_word(unsigned long long seed,
                                                                      unsigned long long word) {
    unsigned long long z = seed + word * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// Grid-stride loop over 8-byte words; bytes are written one by one, so any start address works.
extern "C" __global__ void cudalloc_fill_pattern(unsigned char *dst, unsigned long long len,
                                                 unsigned long long seed) {
    unsigned long long words = (len + 7) / 8;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long w = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; w < words;
         w += stride) {
        unsigned long long value = cudalloc_pattern_word(seed, w);
        for (int b = 0; b < 8; ++b) {
            unsigned long long i = w * 8 + b;
            if (i < len) {
                dst[i] = (unsigned char)(value >> (8 * b));
            }
        }
    }
}

// Adds the number of bytes that differ from the pattern to *mismatches (zeroed by the caller).
extern "C" __global__ void cudalloc_count_mismatches(const unsigned char *src, unsigned long long len,
                                                     unsigned long long seed,
                                                     unsigned long long *mismatches) {
    unsigned long long words = (len + 7) / 8;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long local = 0;
    for (unsigned long long w = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; w < words;
         w += stride) {
        unsigned long long value = cudalloc_pattern_word(seed, w);
        for (int b = 0; b < 8; ++b) {
            unsigned long long i = w * 8 + b;
            if (i < len && src[i] != (unsigned char)(value >> (8 * b))) {
                ++local;
            }
        }
    }
    if (local != 0) {
        atomicAdd(mismatches, local);
    }
}
