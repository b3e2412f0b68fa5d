//! The wrappers used between a raw `clone3` and `execve` (capget, capset, kill) must not touch
//! the heap, not even to report an error: another thread may have held the allocator's lock at
//! clone time. A counting allocator checks it, per thread.

use bb_sys::caps::{capget, capset, CapSets};
use bb_sys::process::{kill, kill_group};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator unchanged; only counts calls on the current thread.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.with(|a| a.set(a.get() + 1));
        // SAFETY: the caller's guarantees for `alloc` are passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: ptr was allocated by System.alloc with this layout (see `alloc`).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.with(|a| a.set(a.get() + 1));
        // SAFETY: the caller's guarantees for `realloc` are passed on unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Run `f` and return how many allocations it made on this thread, with its result.
fn allocations<T>(f: impl FnOnce() -> T) -> (usize, T) {
    let before = ALLOCS.with(Cell::get);
    let out = f();
    (ALLOCS.with(Cell::get) - before, out)
}

#[test]
fn the_allocator_is_counted() {
    let (n, v) = allocations(|| vec![1u8; 16]);
    assert_eq!((n, v.len()), (1, 16));
}

#[test]
fn capget_and_capset_allocate_nothing_even_when_failing() {
    std::thread::spawn(|| {
        let (n, now) = allocations(|| capget(0));
        let now = now.unwrap();
        assert_eq!(n, 0, "capget allocated");
        let (n, e) = allocations(|| capget(i32::MAX));
        assert_eq!((n, e.unwrap_err().errno()), (0, libc::ESRCH), "capget's error allocated");
        let (n, r) = allocations(|| capset(&now));
        r.unwrap();
        assert_eq!(n, 0, "capset allocated");
        // Taking back a dropped (or never held) permitted capability fails with EPERM.
        let more = match (0..64).find(|b| now.permitted & (1u64 << b) != 0) {
            Some(bit) => {
                let mask = !(1u64 << bit);
                capset(&CapSets { effective: now.effective & mask, permitted: now.permitted & mask, ..now }).unwrap();
                now
            }
            None => CapSets { permitted: 1, ..now },
        };
        let (n, e) = allocations(|| capset(&more));
        assert_eq!((n, e.unwrap_err().errno()), (0, libc::EPERM), "capset's error allocated");
    })
    .join()
    .unwrap();
}

#[test]
fn kill_allocates_nothing_even_when_failing() {
    let (n, e) = allocations(|| kill(i32::MAX, 0));
    assert_eq!((n, e.unwrap_err().errno()), (0, libc::ESRCH));
    let (n, e) = allocations(|| kill(0, libc::SIGKILL));
    assert_eq!((n, e.unwrap_err().errno()), (0, libc::EINVAL));
    let (n, e) = allocations(|| kill_group(1, libc::SIGKILL));
    assert_eq!((n, e.unwrap_err().errno()), (0, libc::EINVAL));
    let (n, r) = allocations(|| kill(std::process::id() as i32, 0));
    assert_eq!((n, r.is_ok()), (0, true));
}
