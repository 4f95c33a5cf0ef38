//! Every API name the README and the guides speak of exists (issue 47: the README named
//! `wake_up_with`, which did not). The fenced Rust examples are compiled as doctests (the README
//! through `ReadmeDoctests`, the guides as `cudalloc::guide`); this test reads the prose: each
//! inline code span's `Type::name` must be an item of the public API (`docs/public-api.txt`,
//! itself checked against the crate by `tests/public_api.rs`) and each `name(` call a function or
//! method of it — unless it is a name of another project the text cites (PyTorch's, CUDA's,
//! NIXL's, the standard library's), listed below.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::Path;

/// Calls the documents cite that are not cudalloc's: PyTorch's and CUDA's (the peers compared),
/// NIXL's and UCX's, the standard library's, cudarc's, the OS's.
const FOREIGN: &[&str] = &[
    // PyTorch (torch.cuda and c10 names the text compares with)
    "caching_allocator_alloc",
    "caching_allocator_delete",
    "empty",
    "empty_cache",
    "memory_snapshot",
    "_record_memory_history",
    "_dump_snapshot",
    "_snapshot",
    "record_stream",
    "set_per_process_memory_fraction",
    "use_mem_pool",
    "MemPool",
    "graph",
    "clone",
    "share_memory_",
    "storage",
    "add_remote_agent",
    "get_agent_metadata",
    "get_local_md",
    "make_connection",
    "send_notif",
    "get_xfer_descs",
    // CUDA driver and runtime
    "cuMemHostAlloc",
    "cuMemHostRegister",
    "cuMemCreate",
    "cuMemMap",
    "cudaMallocAsync",
    "cudaMalloc",
    "cudaFree",
    "cudaEventDestroy",
    "cudaIpcGetMemHandle",
    "cuInit",
    // the standard library (`Default::default` of the API's types), cudarc, the OS
    "default",
    "synchronize",
    "launch_builder",
    "device_ptr",
    "gemm",
    "arg",
    "launch",
    "new_stream",
    "cu_stream",
    "pidfd_getfd",
    "mlock",
    "fork",
    "unwrap",
    "drop",
    "Arc",
    "Vec",
];

/// The last path segments of every public item: `(Type::name pairs, bare names)`.
fn public_names() -> (BTreeSet<String>, BTreeSet<String>) {
    let listing =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/public-api.txt"))
            .unwrap();
    let (mut pairs, mut names) = (BTreeSet::new(), BTreeSet::new());
    for line in listing.lines().filter(|l| !l.starts_with('#')) {
        let Some(path) = line
            .split_whitespace()
            .find(|w| w.starts_with("cudalloc::"))
        else {
            continue;
        };
        let path = path
            .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .next()
            .unwrap_or_default();
        let parts: Vec<&str> = path.split("::").filter(|p| !p.is_empty()).collect();
        for window in parts.windows(2) {
            pairs.insert(format!("{}::{}", window[0], window[1]));
        }
        names.extend(parts.iter().map(|p| (*p).to_owned()));
    }
    (pairs, names)
}

/// The inline code spans of `text` outside fenced blocks.
fn inline_spans(text: &str) -> Vec<String> {
    let mut spans = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut parts = line.split('`');
        parts.next();
        while let (Some(inside), Some(_)) = (parts.next(), parts.next()) {
            spans.push(inside.to_owned());
        }
    }
    spans
}

/// `Type::name` pairs and `name(` calls in a span.
fn mentions(span: &str) -> (Vec<String>, Vec<String>) {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let (mut pairs, mut calls) = (Vec::new(), Vec::new());
    let chars: Vec<char> = span.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if !ident(chars[i]) || (i > 0 && ident(chars[i - 1])) {
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len() && ident(chars[i]) {
            i += 1;
        }
        let word: String = chars[start..i].iter().collect();
        let after: String = chars[i..].iter().take(2).collect();
        if after == "::" && word.starts_with(|c: char| c.is_ascii_uppercase()) {
            let rest: String = chars[i + 2..].iter().take_while(|&&c| ident(c)).collect();
            if !rest.is_empty() {
                pairs.push(format!("{word}::{rest}"));
            }
        } else if after.starts_with('(')
            && word.contains(|c: char| c.is_ascii_lowercase())
            && !word.chars().all(|c| c.is_ascii_digit())
        {
            let receiver_dotted = start > 0 && chars[start - 1] == '.';
            let bare = start == 0 || !ident(chars[start - 1]);
            if receiver_dotted || bare {
                calls.push(word);
            }
        }
    }
    (pairs, calls)
}

#[test]
fn every_api_name_in_the_docs_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (pairs, names) = public_names();
    let mut documents = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs/guide")).unwrap() {
        documents.push(entry.unwrap().path());
    }
    let mut missing = Vec::new();
    for document in &documents {
        let text = std::fs::read_to_string(document).unwrap();
        for span in inline_spans(&text) {
            let (span_pairs, calls) = mentions(&span);
            for pair in span_pairs {
                let (ty, name) = pair.split_once("::").unwrap();
                let known = pairs.contains(&pair) || !names.contains(ty) || FOREIGN.contains(&name);
                if !known {
                    missing.push(format!("{}: `{span}` names {pair}", document.display()));
                }
            }
            for call in calls {
                if !names.contains(&call) && !FOREIGN.contains(&call.as_str()) {
                    missing.push(format!("{}: `{span}` calls {call}", document.display()));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "names the documents use that the public API does not have:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_check_catches_a_name_that_does_not_exist() {
    let (pairs, names) = public_names();
    let (_, calls) = mentions("runtime.wake_up_with(tags, WakeOptions::default())");
    assert!(calls.contains(&"wake_up_with".to_owned()));
    assert!(!names.contains("wake_up_with"));
    assert!(names.contains("wake_up") && pairs.contains("Storage::data_ptr_on"));
}
