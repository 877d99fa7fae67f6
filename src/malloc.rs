//! glibc's allocator, kept from holding memory the process freed: fewer arenas, and free pages
//! given back once the caches have filled.
//!
//! Why: the initial lists decode every claim and PV in the cluster, and most are dropped at once
//! (a settled or foreign object is kept as its identity or not at all). glibc keeps such freed
//! pages in per-thread arenas (up to 8 per core) and returns them only from the top of a heap.
//! Measured with 10,000 foreign claims and 10,000 static PVs: ~3.3 MiB of the process' RSS were
//! such pages (docs/benchmarks.md). A no-op off glibc.

/// Arenas at most, unless `MALLOC_ARENA_MAX` says otherwise: the controller's threads allocate
/// little at a time, and guest memory is mapped by wasmtime, not taken from malloc.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const ARENAS: libc::c_int = 2;

/// Caps glibc's arenas unless the environment sets a cap (`MALLOC_ARENA_MAX`, or
/// `glibc.malloc.arena_max` in `GLIBC_TUNABLES`). Call before any thread starts: an arena is
/// made per thread on demand.
pub fn limit_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none()
        && !std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("arena_max"))
    {
        // SAFETY: mallopt only sets a tunable of the allocator; called before other threads
        // exist, nothing allocates concurrently.
        #[expect(
            unsafe_code,
            reason = "glibc's mallopt has no safe binding; it sets one tunable, before other threads exist"
        )]
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, ARENAS);
        }
    }
}

/// Returns free pages of every arena to the OS (cheap: a walk of the free lists).
pub fn give_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim is thread-safe (it takes each arena's lock) and only releases pages
    // that hold no allocation.
    #[expect(
        unsafe_code,
        reason = "glibc's malloc_trim has no safe binding; it locks each arena and frees unused pages"
    )]
    unsafe {
        libc::malloc_trim(0);
    }
}
