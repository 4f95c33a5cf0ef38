//! The declared `rust-version` is honest about the dependencies (issue 22): it is at least the
//! highest `rust-version` any crate a Linux user of cudalloc compiles declares — normal
//! dependencies, every feature on, no dev-dependencies, no `cfg(loom)` or other-platform ones —
//! read from `cargo metadata`. (It was 1.86 while the locked `backtrace` and `libloading` needed
//! 1.88.) What this cannot see is cudalloc's own use of newer standard-library items: that needs
//! the old toolchain itself, which this CI cannot download (only the package registries are
//! reachable).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

/// `1.88` and `1.88.0` alike: major, minor, patch.
fn version(text: &str) -> [u64; 3] {
    let mut out = [0; 3];
    for (at, part) in out.iter_mut().zip(text.split('.')) {
        *at = part.parse().unwrap_or(0);
    }
    out
}

#[test]
fn the_declared_rust_version_covers_every_dependency() {
    let manifest = env!("CARGO_MANIFEST_DIR");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let host = std::env::consts::ARCH.to_owned() + "-unknown-linux-gnu";
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--all-features"])
        .args(["--filter-platform", &host])
        .current_dir(manifest)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let packages: BTreeMap<&str, &serde_json::Value> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["id"].as_str().unwrap(), p))
        .collect();
    let nodes: BTreeMap<&str, &serde_json::Value> = meta["resolve"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| (n["id"].as_str().unwrap(), n))
        .collect();
    let root = meta["resolve"]["root"].as_str().unwrap();
    let declared = packages[root]["rust_version"]
        .as_str()
        .expect("Cargo.toml declares a rust-version");
    // Walk the normal (non-dev, non-build-only is kept: build scripts compile too) edges.
    let mut seen = BTreeSet::new();
    let mut stack = vec![root];
    while let Some(id) = stack.pop() {
        if !seen.insert(id) {
            continue;
        }
        for dep in nodes[id]["deps"].as_array().unwrap() {
            let normal_or_build = dep["dep_kinds"]
                .as_array()
                .unwrap()
                .iter()
                .any(|k| k["kind"].as_str() != Some("dev"));
            if normal_or_build {
                stack.push(dep["pkg"].as_str().unwrap());
            }
        }
    }
    let mut needs: Vec<([u64; 3], String)> = seen
        .iter()
        .filter(|id| **id != root)
        .filter_map(|id| {
            let p = packages[id];
            let v = p["rust_version"].as_str()?;
            Some((
                version(v),
                format!(
                    "{} {} needs {v}",
                    p["name"].as_str().unwrap_or("?"),
                    p["version"].as_str().unwrap_or("?")
                ),
            ))
        })
        .collect();
    needs.sort();
    let highest = needs.last().expect("dependencies declare rust versions");
    println!(
        "msrv: rust-version {declared}; {} crates compiled for a user, the highest: {}",
        seen.len() - 1,
        highest.1
    );
    assert!(
        version(declared) >= highest.0,
        "rust-version {declared} in Cargo.toml is lower than what the dependencies need: {}",
        needs
            .iter()
            .filter(|(v, _)| *v > version(declared))
            .map(|(_, s)| s.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
}
