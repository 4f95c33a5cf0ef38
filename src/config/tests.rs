//! The grammar's and the printed form's tests.
use super::*;

/// A key given twice was taken silently (the last won); a `;` between pairs was read as
/// part of a value with no word of why (issue 47).
#[test]
fn a_key_given_twice_is_refused_and_a_semicolon_gets_a_hint() {
    let twice = AllocatorConfig::parse("thread_cache_mb:8,max_split_size_mb:64,thread_cache_mb:4");
    assert!(
        twice.is_err_and(|e| e.to_string().contains("thread_cache_mb is given twice")),
        "a key given twice must be an error naming it"
    );
    // PyTorch's alias names the same key.
    assert!(AllocatorConfig::parse(
        "pinned_use_host_register:True,pinned_use_cuda_host_register:False"
    )
    .is_err());
    let semicolon = AllocatorConfig::parse("expandable_segments:True;max_split_size_mb:128");
    assert!(
        semicolon.is_err_and(|e| e.to_string().contains("separated by ','")),
        "a ';' between pairs must get the hint"
    );
    assert!(AllocatorConfig::parse("expandable_segments:True,max_split_size_mb:128").is_ok());
}

/// `cudalloc info` prints the configuration in force: every key the grammar knows, each
/// read back to the same configuration (it left out `stream_order`, `cross_stream_reuse` and
/// six more).
#[test]
fn the_printed_configuration_names_every_key_and_reads_back() {
    let config = AllocatorConfig::parse(
        "stream_order:manual,cross_stream_reuse:blocks,thread_cache_mb:8,max_split_size_mb:64,\
         pinned_num_register_threads:4,per_process_memory_fraction:[*:0.5,1:0.25]",
    )
    .unwrap_or_default();
    let printed = config.to_string();
    for key in live::KEYS {
        assert!(
            printed.lines().any(|l| l.starts_with(&format!("{key}: "))),
            "{key} missing from:\n{printed}"
        );
    }
    let pairs: Vec<String> = printed
        .lines()
        .filter(|l| !l.ends_with(": off") && !l.ends_with(": unlimited"))
        .map(|l| l.replacen(": ", ":", 1))
        .collect();
    let again = AllocatorConfig::parse(&pairs.join(","));
    assert_eq!(again.ok(), Some(config));
}

#[test]
fn default_stream_choices_parse() {
    for (text, want) in [
        ("", DefaultStream::Legacy),
        ("default_stream:legacy", DefaultStream::Legacy),
        ("default_stream:per_thread", DefaultStream::PerThread),
        ("default_stream:dedicated", DefaultStream::Dedicated),
    ] {
        assert_eq!(
            AllocatorConfig::parse(text).map(|c| c.default_stream).ok(),
            Some(want)
        );
    }
}

#[test]
fn the_oom_snapshot_path_needs_a_path_and_the_pickle_feature() {
    let parsed = AllocatorConfig::parse("oom_snapshot_path:/tmp/oom.pickle");
    if cfg!(feature = "pickle") {
        assert_eq!(
            parsed.ok().and_then(|c| c.oom_snapshot_path).as_deref(),
            Some("/tmp/oom.pickle")
        );
    } else {
        assert!(parsed.is_err_and(|e| e.to_string().contains("pickle")));
    }
    assert!(AllocatorConfig::parse("oom_snapshot_path:").is_err());
}

#[test]
fn pytorch_rejected_strings_are_errors_naming_the_key() {
    for (text, key) in [
        ("foo:1,bar:2", "foo"),
        (
            "garbage_collection_threshold:1.2",
            "garbage_collection_threshold",
        ),
        (
            "garbage_collection_threshold:0",
            "garbage_collection_threshold",
        ),
        ("max_split_size_mb:2", "max_split_size_mb"),
        ("default_stream:null", "default_stream"),
        ("backend:cudaMallocAsync", "backend"),
        ("backend:magic", "backend"),
        ("max_non_split_rounding_mb:-1", "max_non_split_rounding_mb"),
        ("max_split_size_mb:-1", "max_split_size_mb"),
        (
            "release_lock_on_cudamalloc:none",
            "release_lock_on_cudamalloc",
        ),
        (
            "pinned_use_cuda_host_register:none",
            "pinned_use_cuda_host_register",
        ),
        (
            "pinned_num_register_threads:1024",
            "pinned_num_register_threads",
        ),
        (
            "pinned_num_register_threads:3",
            "pinned_num_register_threads",
        ),
        (
            "pinned_reserve_segment_size_mb:-1",
            "pinned_reserve_segment_size_mb",
        ),
        ("pinned_use_host_register:yes", "pinned_use_host_register"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions"),
        (
            "roundup_power2_divisions:[100:1,>:2]",
            "roundup_power2_divisions",
        ),
        (
            "roundup_power2_divisions:[64:8,>:3]",
            "roundup_power2_divisions",
        ),
        ("expandable_segments:maybe", "expandable_segments"),
        (
            "per_process_memory_fraction:1.5",
            "per_process_memory_fraction",
        ),
    ] {
        let err = AllocatorConfig::parse(text).unwrap_err();
        assert!(err.to_string().contains(key), "{text}: {err}");
        assert_eq!(err.kind(), crate::ErrorKind::Config);
    }
    assert!(AllocatorConfig::parse("max_split_size_mb").is_err());
}

#[test]
fn accepted_settings() {
    let c = AllocatorConfig::parse(
        "max_split_size_mb:40, garbage_collection_threshold:0.5, release_lock_on_cudamalloc:True,\
         expandable_segments:False,pinned_use_cuda_host_register:False",
    )
    .unwrap();
    assert_eq!(c.max_split_size, 40 * MIB);
    assert_eq!(c.garbage_collection_threshold, 0.5);
    assert!(c.release_lock_on_cudamalloc);
    let keys = AllocatorConfig::parse("backend:native,max_non_split_rounding_mb:100").unwrap();
    assert_eq!(keys.max_non_split_rounding, 100 * MIB);
    assert_eq!(AllocatorConfig::default().max_non_split_rounding, 20 * MIB);
    assert_eq!(
        AllocatorConfig::parse("").unwrap(),
        AllocatorConfig::default()
    );
}

#[test]
fn memory_fractions_both_forms_and_the_printed_form_reads_back() {
    let every = AllocatorConfig::parse("per_process_memory_fraction:0.5").unwrap();
    assert_eq!(every.memory_fraction(0), Some(0.5));
    assert_eq!(every.memory_fraction(7), Some(0.5));
    assert_eq!(AllocatorConfig::default().memory_fraction(0), None);
    let list = AllocatorConfig::parse("per_process_memory_fraction:[1:0.25,*:0.75]").unwrap();
    assert_eq!(list.per_process_memory_fraction, 0.75);
    assert_eq!(list.memory_fraction(0), Some(0.75));
    assert_eq!(list.memory_fraction(1), Some(0.25));
    // A device's own value is in force even at 1.0; no `*` is 1.0 for the others.
    let own = AllocatorConfig::parse("per_process_memory_fraction:[0:1]").unwrap();
    assert_eq!(own.memory_fraction(0), Some(1.0));
    assert_eq!(own.memory_fraction(1), None);
    // The plain form is the key's whole value: the devices' own values go.
    let mut cleared = list.clone();
    cleared.apply("per_process_memory_fraction:0.5").unwrap();
    assert_eq!(cleared, every);
    // What `Display` prints (and `cudalloc info`) is the setting, and reads back.
    for config in [&every, &list, &own, &AllocatorConfig::default()] {
        let printed = config.to_string();
        let line = printed
            .lines()
            .find(|l| l.starts_with("per_process_memory_fraction:"))
            .unwrap();
        assert_eq!(&AllocatorConfig::parse(line).unwrap(), config, "{line}");
    }
    let mut set = AllocatorConfig::default();
    set.set_device_memory_fraction(0, 0.5).unwrap();
    assert!(set.set_device_memory_fraction(0, 1.5).is_err());
    assert!(set.set_device_memory_fraction(0, f64::NAN).is_err());
    assert_eq!(set.memory_fraction(0), Some(0.5));
    for bad in [
        "per_process_memory_fraction:[0:1.5]",
        "per_process_memory_fraction:[x:0.5]",
        "per_process_memory_fraction:[0:0.5,0:0.25]",
        "per_process_memory_fraction:[*:0.5,*:0.25]",
        "per_process_memory_fraction:[0:0.5",
        "per_process_memory_fraction:[0.5]",
    ] {
        let err = AllocatorConfig::parse(bad).unwrap_err();
        assert!(
            err.to_string().contains("per_process_memory_fraction"),
            "{bad}: {err}"
        );
    }
}

#[test]
fn roundup_divisions_both_forms() {
    let single = AllocatorConfig::parse("roundup_power2_divisions:4").unwrap();
    assert!(single.roundup_power2_divisions.iter().all(|&d| d == 4));
    let list = AllocatorConfig::parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").unwrap();
    // Intervals: index i covers sizes in [2^i MiB, 2^(i+1) MiB).
    assert_eq!(list.divisions_for(1), 1);
    assert_eq!(list.divisions_for(255 * MIB), 1);
    assert_eq!(list.divisions_for(256 * MIB), 2);
    assert_eq!(list.divisions_for(600 * MIB), 4);
    assert_eq!(list.divisions_for(1024 * MIB), 8);
    assert_eq!(list.divisions_for(1 << 45), 8);
}
