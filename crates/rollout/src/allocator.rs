//! The process's allocator: jemalloc for every allocation (Rust's through the global
//! allocator, and, its symbols being unprefixed, CPython's and torch's through `malloc`), and
//! the options it starts with. See docs/memory.md.

#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read at its start-up before `MALLOC_CONF` (which overrides them).
/// - `oversize_threshold:0`: its default serves blocks of 8 MiB and more from an arena that
///   returns them to the kernel when freed, so every large activation of a training pass
///   faulted its pages in afresh: 8-10% slower steps than glibc's `malloc` (FSDP-sharded
///   ranks on the CPU: 1.8x slower, gathering every block into fresh pages).
/// - `dirty_decay_ms:-1`: by default freed pages go back to the kernel gradually over 10 s,
///   so a step of a few seconds found much of what the step before freed purged and faulted
///   it in again (100-200 thousand page faults per forward pass of the 25M model). Kept,
///   they are reused, for a peak 0.5-1.4% higher in the workloads measured.
/// - `narenas:1`: by default each thread allocates from one of 4 arenas per core, and the
///   pages an arena keeps serve only its own threads: the pages torch's second OpenMP thread
///   freed in a training pass stayed beside the main thread's, 57-64 MiB more peak on the
///   25M model (`bench/e2e_vs_trl`'s `rollout run`), at the same step time. Python's
///   allocations are serialised by its lock anyway, and small ones go through per-thread
///   caches.
///
/// See docs/memory.md.
// SAFETY: jemalloc declares `malloc_conf` as a weak `const char *` for the program to define;
// this is a pointer to a NUL-terminated string that lives for the whole process.
#[allow(unsafe_code)]
#[unsafe(export_name = "malloc_conf")]
static JEMALLOC_OPTIONS: &[u8; 49] = b"oversize_threshold:0,dirty_decay_ms:-1,narenas:1\0";

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::ffi::{CStr, c_void};

    /// A jemalloc option of type `T` (`size_t`, `ssize_t` or `unsigned`).
    fn read<T: Copy + Default>(name: &CStr) -> T {
        let (mut value, mut size) = (T::default(), size_of::<T>());
        // SAFETY: `name` is NUL-terminated; jemalloc writes at most `size` bytes into `value`,
        // which has the option's type and outlives the call.
        #[allow(unsafe_code)]
        let code = unsafe {
            tikv_jemalloc_sys::mallctl(
                name.as_ptr(),
                (&raw mut value).cast::<c_void>(),
                &raw mut size,
                std::ptr::null_mut(),
                0,
            )
        };
        assert_eq!(code, 0, "mallctl {name:?}");
        value
    }

    #[test]
    fn the_binary_starts_jemalloc_with_one_arena_keeping_freed_pages() {
        assert_eq!(read::<usize>(c"opt.oversize_threshold"), 0);
        assert_eq!(read::<isize>(c"opt.dirty_decay_ms"), -1);
        assert_eq!(read::<u32>(c"opt.narenas"), 1);
        assert_eq!(read::<u32>(c"arenas.narenas"), 1);
    }
}
