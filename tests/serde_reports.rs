//! Stats and snapshots serialize (feature `serde`), with PyTorch's names for trace actions and
//! block states, so a library can ship them to its own telemetry.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;

#[test]
fn stats_and_snapshots_serialize_with_pytorch_names() {
    let a = checked_allocator(std::sync::Arc::new(host_driver()), "");
    a.record_memory_history(cudalloc::stats::HistoryOptions::new(
        cudalloc::stats::HistoryMode::All,
        16,
    ));
    let block = a.allocate(0, 1 << 20).unwrap();
    let stats = serde_json::to_value(a.memory_stats(0).unwrap()).unwrap();
    assert_eq!(stats["allocated_bytes"]["all"]["current"], 1 << 20);
    let snapshot = serde_json::to_value(a.snapshot()).unwrap();
    let segment = &snapshot["segments"][0];
    assert_eq!(segment["segment_type"], "small");
    assert_eq!(segment["blocks"][0]["state"], "active_allocated");
    let actions: Vec<&str> = snapshot["trace"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert!(
        actions.contains(&"segment_alloc") && actions.contains(&"alloc"),
        "{actions:?}"
    );
    drop(block);
}
