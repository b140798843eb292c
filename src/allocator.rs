//! The memory allocator of the `cairn` binary (and of the benchmarks that measure it): jemalloc,
//! returning freed memory to the OS from a background thread.
//!
//! Why not glibc's malloc: the engine allocates many small, short-lived values per event, and
//! a profile of one session's turns put about a fifth of the CPU in glibc's `malloc` and
//! `free`; with jemalloc, 128 sessions in flight ran about 1.3× the turns/s (docs/benchmarks.md).
//! Why not mimalloc, which was faster still: with sled, 100,000 parked sessions took 134 MiB
//! under it against 79 MiB under glibc, over the 100 MB goal.
//!
//! Why the options: jemalloc purges freed pages only when the process calls into it, so a
//! process that goes quiet (sessions parked, waiting for their next message) would keep the
//! memory its last burst freed. A background thread purges dirty pages after a second of
//! disuse instead, and muzzy pages at once: 100,000 parked sessions settle at about 70–80 MiB
//! on either engine instead of keeping their peak.

use std::ffi::c_char;

/// The allocator to install with `#[global_allocator]`.
pub type Allocator = tikv_jemallocator::Jemalloc;

/// The options string jemalloc reads at its start, as C's `const char *malloc_conf`.
#[repr(transparent)]
pub struct MallocConf(*const c_char);

// SAFETY: the pointer is to a static, immutable, NUL-terminated string.
unsafe impl Sync for MallocConf {}

/// jemalloc's `malloc_conf` (under the prefixed name the jemalloc of `tikv-jemalloc-sys` looks
/// for), read before `main`. `_RJEM_MALLOC_CONF` in the environment still overrides it.
#[export_name = "_rjem_malloc_conf"]
pub static MALLOC_CONF: MallocConf = MallocConf(
    c"background_thread:true,max_background_threads:1,dirty_decay_ms:1000,muzzy_decay_ms:0"
        .as_ptr(),
);
