// Poison kernel: byte i of the range becomes byte (i % 4) of 0xDEADBEEF, little endian
// (EF BE AD DE ...), the same bytes the host backend writes into freed segments.

extern "C" __global__ void cudalloc_poison(unsigned char *dst, unsigned long long len) {
    const unsigned int poison = 0xDEADBEEFu;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < len;
         i += stride) {
        dst[i] = (unsigned char)(poison >> (8 * (i % 4)));
    }
}
