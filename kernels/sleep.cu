// Sleep kernel (like torch.cuda._sleep): one thread spins on the global nanosecond timer so the
// stream stays busy for `nanos` nanoseconds. Tests use it to expose missing synchronization.

extern "C" __global__ void cudalloc_sleep(unsigned long long nanos) {
    unsigned long long start;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    unsigned long long now = start;
    while (now - start < nanos) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    }
}
