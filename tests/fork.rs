//! A forked child that exits normally must not unlink the parent's shared-memory objects (the
//! `atexit` hook is inherited through `fork`), nor share through its parent's runtime. Its own test
//! binary: the forks happen one at a time (`FORKS`), while no other test of the binary runs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use cudalloc::{ipc::IpcHandle, Runtime, Storage};

/// One fork at a time: a fork while another test thread holds a lock would copy it held.
static FORKS: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn a_forked_child_exiting_normally_leaves_the_parents_objects() {
    let _one = FORKS.lock().unwrap();
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

#[test]
fn a_forked_child_cannot_share_through_its_parents_runtime() {
    // The child would count in the parent's ref-counter slots, and memory of an expandable segment
    // would be named by the parent's page socket, which knows nothing of the child's share.
    let _one = FORKS.lock().unwrap();
    for conf in ["", "expandable_segments:True"] {
        let config = cudalloc::AllocatorConfig::parse(conf).unwrap();
        let a = Arc::new(
            Runtime::builder()
                .config(config)
                .build(Arc::new(host_driver()))
                .unwrap(),
        );
        let shared = Storage::new(&a, 0, 1 << 20).unwrap();
        drop(shared.share_ipc().unwrap()); // the parent shares (page socket started)
        let fresh = Storage::new(&a, 0, 1 << 20).unwrap();
        // SAFETY: the child only shares (taking locks no other thread of this process holds now:
        // no other test runs) and ends with `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let code = match fresh.share_ipc() {
                Err(e) if e.to_string().contains("forked child") => 0,
                Err(_) => 2,
                Ok(_) => 3,
            };
            // SAFETY: ends the child at once, without the parent's exit hooks.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child we just forked; `status` is a valid out-pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status));
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "{conf:?}: 2 = another error, 3 = shared"
        );
        // The parent still shares.
        drop(fresh.share_ipc().unwrap());
    }
}
