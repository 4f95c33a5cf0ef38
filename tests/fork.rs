//! A forked child that exits normally must not unlink the parent's shared-memory objects (the
//! `atexit` hook is inherited through `fork`). Its own test binary: the fork happens while this is
//! the only test thread.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use cudalloc::{IpcHandle, Runtime, Storage};

#[test]
fn a_forked_child_exiting_normally_leaves_the_parents_objects() {
    let driver = Arc::new(host_driver());
    let prefix = driver.shm_name_prefix();
    let a = Arc::new(Runtime::new(driver, Default::default()).unwrap());
    let s = Storage::new(&a, 0, 1 << 20).unwrap();
    s.fill_pattern(9).unwrap();
    let bytes = s.share_ipc().unwrap().into_bytes();
    let mine = format!("cudalloc-{}-", std::process::id());
    let before = shm_names_with_prefix(&mine);
    assert!(
        before.iter().any(|n| n.starts_with(&prefix)) && before.iter().any(|n| n.contains("-ref")),
        "a segment, an event chunk and a ref-counter file exist: {before:?}"
    );
    // SAFETY: the child only calls `exit`, which runs the inherited atexit hooks (the bug).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: ends the child normally, running atexit handlers, as a Python or C child would.
        unsafe { libc::exit(0) };
    }
    let mut status = 0;
    // SAFETY: waits for the child we just forked; `status` is a valid out-pointer.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
    let after = shm_names_with_prefix(&mine);
    let mut missing: Vec<_> = before.iter().filter(|n| !after.contains(n)).collect();
    missing.sort();
    assert!(missing.is_empty(), "the child unlinked {missing:?}");
    // The handle still opens (in this process: the original storage).
    let back = Storage::from_ipc(&a, IpcHandle::from_bytes(&bytes).unwrap()).unwrap();
    assert!(back.is_alias_of(&s));
}
