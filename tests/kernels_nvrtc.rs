//! The kernels of `kernels/*.cu` compile with NVRTC to PTX that has every entry point the CUDA
//! backend looks up — a real compile check that needs no GPU, only the NVRTC library (CI installs
//! the `nvidia-cuda-nvrtc-cu12` wheel and puts it on `LD_LIBRARY_PATH`). Without NVRTC the compile
//! test prints why it was skipped.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cudalloc::internals::kernels;
use cudalloc::internals::pattern;

#[test]
fn every_kernel_file_compiles_to_ptx_with_its_entry_points() {
    if !kernels::nvrtc_present() {
        println!("every_kernel_file_compiles_to_ptx_with_its_entry_points: skipped: NVRTC library not found");
        return;
    }
    let compiled = kernels::compile_all().unwrap();
    assert_eq!(compiled.ptx.len(), kernels::SOURCES.len());
    let entries = [
        (
            "pattern.cu",
            &["cudalloc_fill_pattern", "cudalloc_count_mismatches"][..],
        ),
        ("poison.cu", &["cudalloc_poison"][..]),
        ("sleep.cu", &["cudalloc_sleep"][..]),
    ];
    for (file, names) in entries {
        let (_, ptx) = compiled.ptx.iter().find(|(f, _)| *f == file).unwrap();
        for name in names {
            assert!(
                ptx.contains(&format!(".entry {name}")),
                "{file}: no .entry {name} in PTX"
            );
        }
        println!("{file}: {} bytes of PTX", ptx.len());
    }
}

#[test]
fn the_cuda_pattern_uses_the_host_pattern_constants() {
    let (_, source) = kernels::SOURCES
        .iter()
        .find(|(f, _)| *f == "pattern.cu")
        .unwrap();
    let source = source.to_ascii_uppercase().replace('_', "");
    for constant in [
        pattern::GOLDEN,
        0xBF58_476D_1CE4_E5B9,
        0x94D0_49BB_1331_11EB,
    ] {
        let text = format!("0X{constant:016X}ULL");
        assert!(source.contains(&text), "pattern.cu lacks {text}");
    }
    for shift in ["(Z >> 30)", "(Z >> 27)", "(Z >> 31)"] {
        assert!(source.contains(shift), "pattern.cu lacks {shift}");
    }
    let (_, poison) = kernels::SOURCES
        .iter()
        .find(|(f, _)| *f == "poison.cu")
        .unwrap();
    assert!(poison.contains(&format!("0x{:X}u", pattern::POISON_WORD)));
}
