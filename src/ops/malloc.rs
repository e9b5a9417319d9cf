//! glibc malloc settings for a process that downloads: keep freed receive buffers.
//!
//! Every body chunk of a download is a fresh buffer of up to ~400 KiB from the HTTP client
//! (hyper), freed by the cache writer once written. With glibc's defaults such buffers are
//! `mmap`ed and unmapped, or returned to the kernel when a heap's free top passes the trim
//! threshold, so the next `recv` faults in and zeroes new pages for every byte received:
//! `perf` on a cold epoch of `bench/cache_bench.py` showed page faults under `recv` at 12 % of
//! the daemon's CPU (`clear_page_erms`, `exc_page_fault`, 141 `madvise` calls per 0.5 GB).
//! Serving such buffers from the heap, and keeping up to 32 MiB of free heap per arena,
//! reuses the same pages. `GLIBC_TUNABLES` with malloc settings, if set, wins.

/// Allocations up to this size come from the heap (glibc's default starts at 128 KiB).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: i32 = 4 << 20;
/// Free memory at a heap's top kept, not returned to the kernel (default 128 KiB, growing
/// with the mmap threshold): more than the write queue and the receive buffers in flight.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_THRESHOLD: i32 = 32 << 20;

/// Applies the settings; call before any thread starts. A no-op outside glibc.
pub fn tune() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let tunables = std::env::var_os("GLIBC_TUNABLES").unwrap_or_default();
        if tunables.to_string_lossy().contains("glibc.malloc.") {
            return;
        }
        // SAFETY: mallopt only sets allocator parameters; it takes the arena lock itself.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
            libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
        }
    }
}
