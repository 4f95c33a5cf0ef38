//! `GLOBAL` built from the environment (in child processes, so each gets a fresh process-wide
//! allocator), and `Storage` semantics: aliasing, the write path, host copies, empty storages.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use common::*;
use cudalloc::{ErrorKind, Runtime, Storage, GLOBAL};

const MIB: u64 = 1 << 20;

fn run_child(entry: &str, env: &[(&str, &str)]) -> String {
    let out = child_command(entry, entry)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "child {entry} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn global_is_built_from_the_environment() {
    let out = run_child(
        "global_child_uses_env",
        &[
            ("CUDALLOC_BACKEND", "host"),
            ("CUDALLOC_HOST_DEVICES", "2"),
            ("CUDALLOC_HOST_MEMORY", "128MiB"),
            ("CUDALLOC_CONF", "max_split_size_mb:64"),
        ],
    );
    assert!(out.contains("global ok"), "{out}");
}

#[test]
#[ignore = "child process entry: run by global_is_built_from_the_environment"]
fn global_child_uses_env() {
    if std::env::var(ROLE_VAR).is_err() {
        return;
    }
    let a = GLOBAL.get().unwrap();
    assert_eq!(a.device_count(), 2);
    assert_eq!(a.driver().mem_info(1).unwrap().total, 128 * MIB);
    assert_eq!(a.config().max_split_size, 64 * MIB);
    let s = GLOBAL.storage(1, 3 * MIB).unwrap();
    s.fill_pattern(7).unwrap();
    assert_eq!(s.count_pattern_mismatches(7).unwrap(), 0);
    let stats = GLOBAL.get().unwrap().memory_stats(1).unwrap();
    assert_eq!(stats.allocated_bytes.all.current, (3 * MIB) as i64);
    assert_eq!(stats.max_split_size, (64 * MIB) as i64);
    assert!(GLOBAL
        .get()
        .unwrap()
        .memory_summary(1)
        .unwrap()
        .contains("device 1"));
    assert_eq!(GLOBAL.get().unwrap().ipc_collect().storages, 0);
    drop(s);
    GLOBAL.get().unwrap().empty_cache();
    assert_eq!(GLOBAL.get().unwrap().snapshot().segments.len(), 0);
    println!("global ok");
}

#[test]
fn global_reports_a_bad_environment_as_a_config_error() {
    let out = run_child(
        "global_child_bad_env",
        &[("CUDALLOC_BACKEND", "host"), ("CUDALLOC_CONF", "foo:1")],
    );
    assert!(out.contains("config error twice"), "{out}");
}

#[test]
#[ignore = "child process entry: run by global_reports_a_bad_environment_as_a_config_error"]
fn global_child_bad_env() {
    if std::env::var(ROLE_VAR).is_err() {
        return;
    }
    for _ in 0..2 {
        let err = GLOBAL.get().unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Config);
        assert!(err.to_string().contains("foo"), "{err}");
    }
    // An init after that failed first use says the setup failed and why (before: "already set
    // up", as if it had worked).
    let err = GLOBAL
        .init(
            cudalloc::Runtime::builder(),
            cudalloc::backend::BackendChoice::Host,
        )
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    let text = err.to_string();
    assert!(text.contains("failed") && text.contains("foo"), "{text}");
    println!("config error twice");
}

#[test]
fn global_configured_from_code_ignores_the_environment_and_refuses_a_second_init() {
    let out = run_child(
        "global_child_init",
        &[("CUDALLOC_BACKEND", "quantum"), ("CUDALLOC_CONF", "foo:1")],
    );
    assert!(out.contains("init ok"), "{out}");
}

#[test]
#[ignore = "child process entry: run by global_configured_from_code_ignores_the_environment"]
fn global_child_init() {
    if std::env::var(ROLE_VAR).is_err() {
        return;
    }
    let driver = Arc::new(
        cudalloc::backend::HostDriver::builder()
            .devices(1)
            .memory_per_device(96 * MIB)
            .build()
            .unwrap(),
    );
    let config = cudalloc::AllocatorConfig::parse("max_split_size_mb:32").unwrap();
    let runtime = GLOBAL
        .init_with_driver(Runtime::builder().config(config), driver)
        .unwrap();
    assert_eq!(runtime.config().max_split_size, 32 * MIB);
    assert_eq!(GLOBAL.backend().unwrap(), cudalloc::backend::Backend::Host);
    assert_eq!(GLOBAL.fallback_reason().unwrap(), None);
    assert_eq!(GLOBAL.get().unwrap().device_count(), 1);
    let s = GLOBAL.storage(0, MIB).unwrap();
    assert_eq!(
        GLOBAL.get().unwrap().memory_stats_map(0).unwrap()["allocated_bytes.all.current"],
        MIB as i64
    );
    // A second set-up, whichever way, is refused and changes nothing.
    let again = GLOBAL
        .init(Runtime::builder(), cudalloc::backend::BackendChoice::Host)
        .unwrap_err();
    assert_eq!(again.kind(), ErrorKind::Config);
    assert!(again.to_string().contains("already set up"), "{again}");
    assert_eq!(GLOBAL.get().unwrap().config().max_split_size, 32 * MIB);
    drop(s);
    println!("init ok");
}

#[test]
fn init_after_first_use_is_a_clear_error_and_auto_says_why_it_fell_back() {
    let out = run_child(
        "global_child_late_init",
        &[
            ("CUDALLOC_BACKEND", "auto"),
            ("LD_LIBRARY_PATH", "/nonexistent"),
        ],
    );
    assert!(out.contains("late init refused"), "{out}");
}

#[test]
#[ignore = "child process entry: run by init_after_first_use_is_a_clear_error"]
fn global_child_late_init() {
    if std::env::var(ROLE_VAR).is_err() {
        return;
    }
    let _first_use = GLOBAL.storage(0, 4096).unwrap();
    let err = GLOBAL
        .init(Runtime::builder(), cudalloc::backend::BackendChoice::Host)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Config);
    assert!(err.to_string().contains("call GLOBAL.init before"), "{err}");
    if GLOBAL.backend().unwrap() == cudalloc::backend::Backend::Host {
        let why = GLOBAL
            .fallback_reason()
            .unwrap()
            .expect("auto fell back: why");
        assert!(
            why.to_lowercase().contains("cuda") || why.contains("libcuda"),
            "{why}"
        );
    }
    println!("late init refused");
}

fn allocator() -> Arc<Runtime> {
    checked_allocator(Arc::new(host_driver()), "")
}

#[test]
fn clones_alias_and_distinct_storages_do_not() {
    let a = allocator();
    let s = Storage::new(&a, 0, 4096).unwrap();
    let alias = s.clone();
    let other = Storage::new(&a, 0, 4096).unwrap();
    assert!(s.is_alias_of(&alias));
    assert!(!s.is_alias_of(&other));
    assert_eq!(s.unordered_data_ptr(), alias.unordered_data_ptr());
    assert_ne!(s.unordered_data_ptr(), other.unordered_data_ptr());
    assert_eq!(
        s.unordered_mutable_data_ptr().unwrap(),
        s.unordered_data_ptr()
    );
    // Writes through one alias are seen through the other.
    s.copy_from_host(
        s.runtime().current_stream(s.device()).unwrap(),
        0,
        &[1, 2, 3, 4],
    )
    .unwrap();
    let mut back = [0u8; 4];
    alias
        .copy_to_host(
            alias.runtime().current_stream(alias.device()).unwrap(),
            0,
            &mut back,
        )
        .unwrap();
    assert_eq!(back, [1, 2, 3, 4]);
    drop(s);
    assert_eq!(
        a.memory_stats(0).unwrap().allocation.all.current,
        2,
        "the alias keeps the data alive"
    );
    drop(alias);
    assert_eq!(a.memory_stats(0).unwrap().allocation.all.current, 1);
}

#[test]
fn storage_copies_are_bounds_checked() {
    let a = allocator();
    let s = Storage::new(&a, 0, 16).unwrap();
    assert_eq!(
        s.copy_from_host(s.runtime().current_stream(s.device()).unwrap(), 0, &[0; 17])
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidArgument
    );
    let mut big = [0u8; 17];
    assert_eq!(
        s.copy_to_host(s.runtime().current_stream(s.device()).unwrap(), 0, &mut big)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidArgument
    );
    let empty = Storage::new(&a, 0, 0).unwrap();
    assert!(empty.unordered_data_ptr().0 == 0 && empty.nbytes() == 0);
    empty
        .copy_from_host(
            empty.runtime().current_stream(empty.device()).unwrap(),
            0,
            &[],
        )
        .unwrap();
}

#[test]
fn storage_clone_data_is_stream_ordered() {
    let a = allocator();
    let d = a.driver().clone();
    let side = a.create_stream(0).unwrap();
    let src = a.allocate(0, MIB).unwrap();
    // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
    unsafe {
        d.kernels()
            .fill_pattern(a.default_stream(0).unwrap(), src.ptr(), MIB, 3)
    }
    .unwrap();
    d.stream_synchronize(a.default_stream(0).unwrap()).unwrap();
    let copy = a.clone_data(&src, MIB, side).unwrap();
    assert_eq!(copy.allocation_stream(), Some(side));
    drop(src); // waits for the copy on `side` (record_stream inside clone_data)
    assert_eq!(
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe {
            d.kernels()
                .count_pattern_mismatches(side, copy.ptr(), MIB, 3)
        }
        .unwrap(),
        0
    );
    assert!(
        a.clone_data(&copy, MIB, a.create_stream(1).unwrap())
            .is_err(),
        "cross-device clone"
    );
}

/// A host kernel's own error type survives (issue 22): `Error::kernel(e)` keeps `e` as the
/// source, the failed stream's later errors keep the kernel's error as theirs, and a caller can
/// walk the chain down to its own type — before, the error was flattened into a string.
#[test]
fn a_host_kernels_own_error_is_the_source_of_what_its_stream_reports() {
    #[derive(Debug)]
    struct BadShape(usize);
    impl std::fmt::Display for BadShape {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "bad shape: {} dimensions", self.0)
        }
    }
    impl std::error::Error for BadShape {}

    let driver = Arc::new(host_driver());
    let rt = Arc::new(Runtime::new(driver.clone(), cudalloc::AllocatorConfig::default()).unwrap());
    let stream = rt.create_stream(0).unwrap();
    let s = Storage::new_on(&rt, stream, 4096).unwrap();
    let ptr = s.mutable_data_ptr_on(stream).unwrap();
    // SAFETY: the kernel's ranges are memory this program owns and orders on its streams; no typed kernel sees them.
    unsafe {
        driver.enqueue_host(
            stream,
            [cudalloc::backend::HostRange::write(ptr, 4096)],
            |_: &mut cudalloc::backend::HostKernelMemory<1>| {
                Err(cudalloc::Error::kernel(BadShape(7)))
            },
        )
    }
    .unwrap();
    let err = cudalloc::backend::Driver::stream_synchronize(&*driver, stream).unwrap_err();
    assert!(err.to_string().contains("bad shape: 7 dimensions"), "{err}");
    let mut chain = Vec::new();
    let mut at: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = at {
        chain.push(e.to_string());
        if let Some(shape) = e.downcast_ref::<BadShape>() {
            assert_eq!(shape.0, 7);
            break;
        }
        at = e.source();
    }
    assert!(
        at.is_some(),
        "the kernel's own error is not in the chain: {chain:?}"
    );
    assert!(chain.len() >= 2, "{chain:?}");
    drop(s);
}
