//! NCCL registration on a GPU (feature `nccl`; run by `scripts/gpu-check.sh`): a one-rank
//! communicator, the allocator's regions registered with it as they are mapped — every page of an
//! expandable segment too — and deregistered by their handles before they go. Without a GPU or
//! without NCCL's library it prints that it was skipped and why (the registrar's lifetimes are
//! tested everywhere by the unit tests of `src/nccl.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use cudalloc::nccl::{NcclComm, NcclRegistrar};
use cudalloc::{
    backend::CudaDriver, registration::OnRegistrationFailure, AllocatorConfig, Runtime, Storage,
};

#[test]
fn regions_are_registered_with_a_communicator_and_deregistered_before_they_go() {
    if !cudalloc::backend::driver_library_present() {
        println!("skipped: no CUDA driver library on this machine (NCCL needs a GPU)");
        return;
    }
    let driver = match CudaDriver::new() {
        Ok(d) => Arc::new(d),
        Err(e) => {
            println!("skipped: the CUDA backend cannot start here ({e})");
            return;
        }
    };
    // SAFETY: only asks the loader whether libnccl can be opened.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        println!("skipped: NCCL's library (libnccl.so.2) is not on this machine");
        return;
    }
    let id = cudarc::nccl::result::get_uniqueid().unwrap();
    let mut raw = std::mem::MaybeUninit::uninit();
    // SAFETY: a one-rank communicator on the current device; `raw` is a valid out-pointer.
    unsafe { cudarc::nccl::result::comm_init_rank(raw.as_mut_ptr(), 1, id, 0) }.unwrap();
    // SAFETY: initialized by the successful call above.
    let raw = unsafe { raw.assume_init() };
    for conf in ["", "expandable_segments:True"] {
        let rt = Arc::new(
            Runtime::builder()
                .config(AllocatorConfig::parse(conf).unwrap())
                .build(driver.clone())
                .unwrap(),
        );
        // SAFETY: `raw` lives until after every registrar made from it is detached (below).
        let comm = unsafe { NcclComm::new(raw) }.unwrap();
        let registrar = Arc::new(NcclRegistrar::new(comm));
        let attached = rt
            .attach_registrar(registrar.clone(), OnRegistrationFailure::FailAllocation)
            .unwrap();
        let storages: Vec<Storage> = [4096, 3 << 20, 50 << 20]
            .iter()
            .map(|&n| Storage::new(&rt, 0, n).unwrap())
            .collect();
        let stats = rt.registration_stats();
        assert_eq!(
            registrar.registered() as u64,
            stats.mapped_regions,
            "{conf}"
        );
        for s in &storages {
            for piece in s.registered_regions().unwrap() {
                assert!(registrar.holds(piece.region.id), "{conf}");
            }
        }
        println!(
            "{conf:?}: {} regions registered with NCCL for {} storages",
            stats.mapped_regions,
            storages.len()
        );
        drop(storages);
        rt.empty_cache();
        assert_eq!(
            registrar.registered(),
            0,
            "{conf}: deregistered before the free"
        );
        assert!(rt.detach_registrar(attached));
    }
    // SAFETY: every registration on `raw` was deregistered above.
    unsafe { cudarc::nccl::result::comm_destroy(raw) }.unwrap();
}
