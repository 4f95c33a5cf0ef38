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
//! | 3    | cow, ipc, pinned | `cow`, `ipc`, `pinned` (not each other) |
//! | 4    | runtime, replay | `runtime`, `replay` (not each other) |
//! | 5    | storage  | `storage`                       |
//! | 6    | global, nixl, nccl | `global`, `nixl`, `nccl` (not each other) |
//! | 7    | command  | `main.rs`, `cli/` (use the public API only) |
//!
//! **Inside every folder, one direction too** (issue 22): the files and subfolders of a folder —
//! its `mod.rs` aside, which declares and re-exports them — name each other without a circle.
//! A reference is a `crate::…`, `super::…` or `self::…` path resolved to the child of the folder
//! it lands in (through the folder's `mod.rs` re-exports when it names an item); the test fails
//! on a circle and prints it, file by file. Method calls name no file and are not arrows: types
//! may be given methods in the files above them (`alloc/engine/mod.rs` holds the allocator's
//! types that point at each other; their methods live above it).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rank(module: &str) -> Option<u32> {
    Some(match module {
        "error" | "sync" | "process" | "config" | "shm" | "codec" | "nvtx" => 0,
        "driver" => 1,
        "alloc" => 2,
        "cow" | "ipc" | "pinned" => 3,
        "runtime" | "replay" => 4,
        "storage" => 5,
        "global" | "nixl" | "nccl" => 6,
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

/// The grouping modules `lib.rs` declares inline (`pub mod stats { pub use crate::alloc::{…}; }`):
/// group → (public name → defining top-level module).
fn groups(lib: &str) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut out: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut rest = lib;
    while let Some(at) = rest.find("pub mod ") {
        rest = &rest[at + "pub mod ".len()..];
        let name_end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        let name = rest[..name_end].to_owned();
        let Some(body) = rest[name_end..].trim_start().strip_prefix('{') else {
            continue; // `pub mod x;`: a module of its own, ranked by its name
        };
        let end = body.find("\n}").unwrap_or(body.len());
        let names = out.entry(name).or_default();
        for stmt in body[..end].replace('\n', " ").split(';') {
            let Some(path) = stmt.trim().strip_prefix("pub use crate::") else {
                continue;
            };
            let (module, items) = path.split_once("::").unwrap_or((path, ""));
            let items = match items.rfind("::{") {
                Some(brace) => &items[brace + 3..],
                None => items,
            };
            let items = items.trim().trim_start_matches('{').trim_end_matches('}');
            for item in items.split(',') {
                let item = item.trim().rsplit("::").next().unwrap_or("").trim();
                let item = item.rsplit(" as ").next().unwrap_or(item).trim();
                if !item.is_empty() {
                    names.insert(item.to_owned(), module.trim().to_owned());
                }
            }
        }
    }
    out
}

/// The top-level modules a line of code names through `crate::` (a grouping module's names
/// resolved to the modules that define them).
fn referenced(
    line: &str,
    roots: &BTreeMap<String, String>,
    groups: &BTreeMap<String, BTreeMap<String, String>>,
) -> Vec<String> {
    let ident_end = |s: &str| {
        s.find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(s.len())
    };
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
            let end = ident_end(rest);
            let head = &rest[..end];
            match (groups.get(head), rest[end..].strip_prefix("::")) {
                (Some(names), Some(after)) => {
                    let items: Vec<&str> = match after.strip_prefix('{') {
                        Some(list) => list[..list.find('}').unwrap_or(list.len())]
                            .split(',')
                            .map(|i| i.trim().split("::").next().unwrap_or(""))
                            .collect(),
                        None => vec![&after[..ident_end(after)]],
                    };
                    for item in items {
                        if let Some(module) = names.get(item) {
                            out.push(module.clone());
                        }
                    }
                }
                _ => heads.push(head.to_owned()),
            }
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
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let roots = reexports(&lib);
    let groups = groups(&lib);
    assert!(roots.contains_key("Storage"), "lib.rs re-exports parsed");
    assert_eq!(
        groups
            .get("stats")
            .and_then(|g| g.get("DeviceStats"))
            .map(String::as_str),
        Some("alloc"),
        "lib.rs grouping modules parsed"
    );
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
            for target in referenced(code, &roots, &groups) {
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
    let groups = groups("pub mod stats {\n    pub use crate::alloc::{DeviceStats, Snapshot};\n}\npub mod backend {\n    pub use crate::driver::host::{HostDriver};\n}\n");
    assert_eq!(
        referenced("use crate::{Storage, alloc::X};", &roots, &groups),
        vec!["storage", "alloc"]
    );
    assert_eq!(
        referenced("let s: crate::ipc::IpcHandle;", &roots, &groups),
        vec!["ipc"]
    );
    // A grouping module's names are their defining modules': a driver naming the statistics
    // through `crate::stats::` names the allocator.
    assert_eq!(
        referenced(
            "use crate::stats::{DeviceStats, Snapshot};",
            &roots,
            &groups
        ),
        vec!["alloc", "alloc"]
    );
    assert_eq!(
        referenced("let d: crate::backend::HostDriver;", &roots, &groups),
        vec!["driver"]
    );
    assert!(rank("storage").unwrap() > rank("alloc").unwrap());
}

/// The module path of a file under `src/` (`alloc/shard.rs` → `[alloc, shard]`, `driver/host/mod.rs`
/// → `[driver, host]`, `lib.rs` → `[]`).
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap();
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_owned());
    }
    parts
}

/// Names a folder's `mod.rs` brings in from its children (`pub use shard::X`, `use self::y::{A, B
/// as C}`): name → child.
fn folder_imports(mod_rs: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let text: String = mod_rs
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join(" ");
    for stmt in text.split(';') {
        let stmt = stmt.trim();
        let Some(at) = stmt.find("use ") else {
            continue;
        };
        let head = stmt[..at].trim();
        if !(head.is_empty() || head.starts_with("pub") || head.ends_with(')')) {
            continue;
        }
        let path = stmt[at + 4..].trim().trim_start_matches("self::");
        let Some((child, names)) = path.split_once("::") else {
            continue;
        };
        if child.starts_with("crate") || child.starts_with("super") || child.contains(' ') {
            continue;
        }
        let names = names.trim().trim_start_matches('{').trim_end_matches('}');
        for name in names.split(',') {
            let name = name.trim();
            let name = name.rsplit(" as ").next().unwrap().trim();
            let name = name.rsplit("::").next().unwrap().trim();
            if !name.is_empty() && name != "self" {
                out.insert(name.to_owned(), child.trim().to_owned());
            }
        }
    }
    out
}

/// The absolute module paths a line of code names through `crate::`, `super::` or `self::`, as
/// seen from module `here` (`is_dir`: the file is a folder's `mod.rs` or the crate root).
fn paths_named(line: &str, here: &[String], is_dir: bool) -> Vec<Vec<String>> {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut out = Vec::new();
    let bytes = line.as_bytes();
    let mut i = 0;
    while i < line.len() {
        let rest = &line[i..];
        let starts_word = i == 0 || !ident(bytes[i - 1] as char);
        let prefix = ["crate::", "super::", "self::"]
            .into_iter()
            .find(|p| rest.starts_with(p));
        let (Some(prefix), true) = (prefix, starts_word) else {
            i += rest.chars().next().map_or(1, char::len_utf8);
            continue;
        };
        // The module the path starts from.
        let mut base: Vec<String> = match prefix {
            "crate::" => Vec::new(),
            _ if is_dir => here.to_vec(),
            _ => here[..here.len().saturating_sub(1)].to_vec(),
        };
        let mut tail = &rest[prefix.len()..];
        if prefix == "super::" {
            if is_dir {
                base.pop();
            }
            while let Some(t) = tail.strip_prefix("super::") {
                base.pop();
                tail = t;
            }
        } else if prefix == "self::" && !is_dir {
            base = here.to_vec();
        }
        // Go on after the prefix and any `super::` chained to it.
        let next = line.len() - tail.len();
        let mut heads = Vec::new();
        let mut segments = Vec::new();
        loop {
            if let Some(group) = tail.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for part in group[..end].split(',') {
                    let part = part.trim();
                    let mut path = segments.clone();
                    for seg in part.split("::") {
                        let seg: String = seg.trim().chars().take_while(|&c| ident(c)).collect();
                        if seg.is_empty() || seg == "self" {
                            break;
                        }
                        path.push(seg);
                    }
                    heads.push(path);
                }
                break;
            }
            let seg: String = tail.chars().take_while(|&c| ident(c)).collect();
            if seg.is_empty() {
                break;
            }
            tail = &tail[seg.len()..];
            segments.push(seg);
            match tail.strip_prefix("::") {
                Some(t) => tail = t,
                None => break,
            }
        }
        if heads.is_empty() {
            heads.push(segments);
        }
        for head in heads {
            let mut path = base.clone();
            path.extend(head);
            out.push(path);
        }
        i = next;
    }
    out
}

/// Every folder's children (file stems and subfolders, `mod.rs` aside) and the arrows between
/// them: folder → (from child, to child) → one line that names the target.
type Arrows = BTreeMap<Vec<String>, BTreeMap<(String, String), String>>;

fn arrows_inside_folders(src: &Path) -> Arrows {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    // Folders (module paths that have a mod.rs, and the crate root) and what their mod.rs brings in.
    let mut folders: BTreeMap<Vec<String>, BTreeMap<String, String>> = BTreeMap::new();
    for file in &files {
        let name = file.file_name().unwrap().to_string_lossy();
        if name == "mod.rs" || file.parent() == Some(src) && name == "lib.rs" {
            let text = std::fs::read_to_string(file).unwrap();
            folders.insert(module_path(src, file), folder_imports(&text));
        }
    }
    let mut arrows = Arrows::new();
    for file in &files {
        let here = module_path(src, file);
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let is_dir = matches!(name.as_str(), "mod.rs" | "lib.rs" | "main.rs");
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for mut target in paths_named(code, &here, is_dir) {
                // An item a folder's mod.rs brings in from a child names that child.
                for len in (0..target.len()).rev() {
                    let (folder, rest) = target.split_at(len);
                    if let Some(child) = folders.get(folder).and_then(|m| m.get(&rest[0])) {
                        let mut resolved = folder.to_vec();
                        resolved.push(child.clone());
                        target = resolved;
                        break;
                    }
                    if folders.contains_key(folder) {
                        break;
                    }
                }
                let common = here.iter().zip(&target).take_while(|(a, b)| a == b).count();
                // Both must go below the common folder (a file naming its own folder's mod.rs
                // items, or a folder's mod.rs naming its children, is no arrow between children).
                if common >= here.len() || common >= target.len() {
                    continue;
                }
                let folder = here[..common].to_vec();
                if !folders.contains_key(&folder) || folder.is_empty() {
                    continue; // between top-level modules: the layer table above decides
                }
                let (from, to) = (here[common].clone(), target[common].clone());
                let at = format!("{}:{}", file.strip_prefix(src).unwrap().display(), n + 1);
                arrows
                    .entry(folder)
                    .or_default()
                    .entry((from, to))
                    .or_insert(at);
            }
        }
    }
    arrows
}

/// A circle among `edges`, if any: the children in order, back to the first.
fn find_circle(edges: &BTreeMap<(String, String), String>) -> Option<Vec<String>> {
    let nodes: BTreeSet<&String> = edges.keys().flat_map(|(a, b)| [a, b]).collect();
    // 0: unseen, 1: on the path, 2: done.
    let mut mark: BTreeMap<&String, u8> = nodes.iter().map(|&n| (n, 0)).collect();
    fn visit<'a>(
        n: &'a String,
        edges: &'a BTreeMap<(String, String), String>,
        mark: &mut BTreeMap<&'a String, u8>,
        path: &mut Vec<&'a String>,
    ) -> Option<Vec<String>> {
        mark.insert(n, 1);
        path.push(n);
        for (a, b) in edges.keys() {
            if a != n {
                continue;
            }
            match mark[b] {
                1 => {
                    let start = path.iter().position(|&p| p == b).unwrap();
                    let mut circle: Vec<String> =
                        path[start..].iter().map(|s| (*s).clone()).collect();
                    circle.push(b.clone());
                    return Some(circle);
                }
                0 => {
                    if let Some(c) = visit(b, edges, mark, path) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        path.pop();
        mark.insert(n, 2);
        None
    }
    for n in nodes {
        if mark[n] == 0 {
            let mut path = Vec::new();
            if let Some(c) = visit(n, edges, &mut mark, &mut path) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn inside_every_folder_the_files_point_one_way() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let arrows = arrows_inside_folders(&src);
    assert!(
        arrows
            .get(&vec!["alloc".to_owned(), "engine".to_owned()])
            .is_some_and(|e| e.keys().filter(|(from, _)| from == "device").count() >= 4),
        "the arrows inside folders were read (alloc/engine/device.rs names at least four of its \
         siblings)"
    );
    let mut circles = Vec::new();
    for (folder, edges) in &arrows {
        if let Some(circle) = find_circle(edges) {
            let steps: Vec<String> = circle
                .windows(2)
                .map(|w| {
                    let at = &edges[&(w[0].clone(), w[1].clone())];
                    format!("  {} -> {} ({at})", w[0], w[1])
                })
                .collect();
            circles.push(format!(
                "src/{}/: {}\n{}",
                folder.join("/"),
                circle.join(" -> "),
                steps.join("\n")
            ));
        }
    }
    assert!(
        circles.is_empty(),
        "import circles inside folders:\n{}",
        circles.join("\n")
    );
    let count: usize = arrows.values().map(BTreeMap::len).sum();
    println!(
        "layering inside folders: {} folders, {count} arrows between their files, no circle",
        arrows.len()
    );
}

#[test]
fn the_folder_checker_resolves_paths_and_finds_a_circle() {
    let here = |p: &str| p.split('/').map(str::to_owned).collect::<Vec<_>>();
    assert_eq!(
        paths_named(
            "use super::{shard::Shard, state::X};",
            &here("alloc/device"),
            false
        ),
        vec![here("alloc/shard/Shard"), here("alloc/state/X")]
    );
    assert_eq!(
        paths_named(
            "let x = super::super::sanitizer::Stack::capture();",
            &here("driver/host/stream"),
            false
        ),
        vec![here("driver/sanitizer/Stack/capture")]
    );
    assert_eq!(
        paths_named("use self::report::Stack;", &here("driver/sanitizer"), true),
        vec![here("driver/sanitizer/report/Stack")]
    );
    assert_eq!(
        folder_imports(
            "pub use stacks::Frame;\npub(crate) use data_ptr::{take_shared, BlockOwner as Owner};"
        )
        .into_iter()
        .collect::<Vec<_>>(),
        vec![
            ("Frame".to_owned(), "stacks".to_owned()),
            ("Owner".to_owned(), "data_ptr".to_owned()),
            ("take_shared".to_owned(), "data_ptr".to_owned()),
        ]
    );
    let mut edges = BTreeMap::new();
    edges.insert(("a".to_owned(), "b".to_owned()), String::new());
    edges.insert(("b".to_owned(), "c".to_owned()), String::new());
    assert_eq!(find_circle(&edges), None);
    edges.insert(("c".to_owned(), "a".to_owned()), String::new());
    assert_eq!(find_circle(&edges).unwrap(), vec!["a", "b", "c", "a"]);
}
