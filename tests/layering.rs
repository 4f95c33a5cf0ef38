//! One direction (DESIGN §1): no module names a layer above it. This test reads every source file
//! under `src/`, finds each `crate::…` path outside comments (with the crate root's re-exports
//! resolved to the module that defines them) and fails on any reference upward — or sideways
//! between `cow` and `ipc`, which are independent.
//!
//! | rank | layer    | modules                         |
//! |------|----------|---------------------------------|
//! | 0    | ground   | `error`, `sync`, `process`, `config`, `shm`, `codec` |
//! | 1    | driver   | `driver`                        |
//! | 2    | alloc    | `alloc`                         |
//! | 3    | cow, ipc | `cow`, `ipc` (not each other)   |
//! | 4    | runtime, replay | `runtime`, `replay` (not each other) |
//! | 5    | storage  | `storage`                       |
//! | 6    | global   | `global`                        |
//! | 7    | command  | `main.rs`, `cli/` (use the public API only) |
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn rank(module: &str) -> Option<u32> {
    Some(match module {
        "error" | "sync" | "process" | "config" | "shm" | "codec" => 0,
        "driver" => 1,
        "alloc" => 2,
        "cow" | "ipc" => 3,
        "runtime" | "replay" => 4,
        "storage" => 5,
        "global" => 6,
        "cli" | "main" => 7,
        _ => return None,
    })
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (`src/alloc/shard.rs` → `alloc`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_owned()
}

/// Root re-exports of `lib.rs`: public name → defining module.
fn reexports(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let text = lib.replace('\n', " ");
    for stmt in text.split(';') {
        let Some(rest) = stmt.trim().strip_prefix("pub use ") else {
            continue;
        };
        let (module, names) = rest.split_once("::").unwrap();
        let names = names.trim().trim_start_matches('{').trim_end_matches('}');
        for name in names.split(',') {
            let name = name.trim().rsplit("::").next().unwrap().trim();
            if !name.is_empty() {
                out.insert(name.to_owned(), module.trim().to_owned());
            }
        }
    }
    out
}

/// The top-level modules a line of code names through `crate::`.
fn referenced(line: &str, roots: &BTreeMap<String, String>) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        let mut heads = Vec::new();
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for part in group[..end].split(',') {
                heads.push(part.trim().split("::").next().unwrap_or("").to_owned());
            }
        } else {
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            heads.push(rest[..end].to_owned());
        }
        for head in heads {
            if head.is_empty() {
                continue;
            }
            match roots.get(&head) {
                Some(module) => out.push(module.clone()),
                None => out.push(head),
            }
        }
    }
    out
}

#[test]
fn no_module_imports_a_layer_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let roots = reexports(&std::fs::read_to_string(src.join("lib.rs")).unwrap());
    assert!(roots.contains_key("Storage"), "lib.rs re-exports parsed");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut violations = Vec::new();
    for file in &files {
        let module = module_of(&src, file);
        if module == "lib" {
            continue; // the facade
        }
        let own = rank(&module).unwrap_or_else(|| panic!("{module}: not in the layer table"));
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for target in referenced(code, &roots) {
                if target == module {
                    continue;
                }
                let Some(theirs) = rank(&target) else {
                    continue;
                };
                let sideways = theirs == own && own != 0;
                if theirs > own || sideways {
                    violations.push(format!(
                        "{}:{}: {module} (layer {own}) names {target} (layer {theirs})",
                        file.strip_prefix(&src).unwrap().display(),
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(
        violations.is_empty(),
        "imports against the layering:\n{}",
        violations.join("\n")
    );
    println!("layering: {} files checked, no upward import", files.len());
}

#[test]
fn the_checker_catches_an_upward_import() {
    let roots = reexports("pub use storage::Storage;\npub use alloc::{CachingAllocator, DataPtr};");
    assert_eq!(
        referenced("use crate::{Storage, alloc::X};", &roots),
        vec!["storage", "alloc"]
    );
    assert_eq!(
        referenced("let s: crate::ipc::IpcHandle;", &roots),
        vec!["ipc"]
    );
    assert!(rank("storage").unwrap() > rank("alloc").unwrap());
}
