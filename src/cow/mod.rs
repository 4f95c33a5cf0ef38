//! Copy-on-write lazy clones.
//!
//! `storage.lazy_clone()` returns a new [`Storage`](crate::Storage) that shares the data through a
//! COW context; reads never copy, and the first write through `mutable_data_ptr()` materializes:
//! the last holder steals the data in place, the others copy it through the allocator's
//! stream-ordered `clone_data`. The protocol is in `cell.rs` (generic, model-checked by
//! `loom_tests/cow.rs`); `context.rs` binds it to device memory and streams.
//!
//! States of a storage:
//!
//! | state            | address word                 | owner                  | `mutable_data_ptr()`              |
//! |------------------|------------------------------|------------------------|-----------------------------------|
//! | plain            | address, tag clear           | block / IPC / none     | one atomic load                   |
//! | COW (shared)     | shared address, tag set      | COW context (count ≥ 2) | copy: new address, tag cleared   |
//! | COW (last)       | shared address, tag set      | COW context (count = 1) | steal: same address, tag cleared |
//!
//! | operation                     | source storage            | context count |
//! |-------------------------------|---------------------------|---------------|
//! | first lazy clone of a plain   | converted to COW in place | 2             |
//! | lazy clone of a COW storage   | unchanged                 | +1            |
//! | materialize (copy)            | —                         | −1            |
//! | materialize (steal) / drop    | —                         | −1 (last frees or hands over the data) |
//! | lazy clone of a shared (IPC sent or received) storage | unchanged | — (eager copy) |
//!
//! Deviation from DESIGN §6 ("any owner can be wrapped"): memory shared with other processes is
//! an alias of their storages, so a COW view of it could change under the clone when a consumer
//! writes, and a steal would take it away from them (a same-process receipt would then name a
//! storage that no longer holds the shared memory). A lazy clone of such a storage is therefore an
//! eager, stream-ordered copy on the current stream — what PyTorch does for storages whose data
//! pointer is not its own. Sharing a COW storage materializes it first, under the same storage lock
//! as the wrapping, and completes that copy before returning.
//!
//! Deviation from DESIGN §6: a lazy clone of a COW storage is one atomic increment *plus* the
//! source storage's own lock, taken to read its owner safely while another thread may be
//! materializing that same storage, *plus* one small allocation: the clone's owner is a boxed
//! `SharedOwner` trait object, so the allocator names no COW type (DESIGN §1). Measured 42–44 ns
//! per lazy clone against 30–38 ns with the old enum variant (`docs/benchmarks.md`). An unboxed
//! counted-reference variant was tried and measured: it grew every `DataPtr` and made the
//! allocate/free pair 25–35 % slower, so it was dropped.
//!
//! This layer works on `DataPtr`s (`lazy_clone`, `materialize`, `is_cow`); the storage layer
//! holds the lock and publishes the address word.
//!
//! Stream order: a copier enqueues its copy on its current stream and marks the source block as
//! used by that stream (as `record_stream` would: a later free waits for it); so does a read of a
//! clone on another stream (`record_stream`, copies to pinned memory). A stealer's change of owner
//! goes through the allocator's hand-over (`alloc/engine/handover.rs`): its stream waits for the block's
//! own stream and every stream recorded on it — copiers, and readers of clones dropped since (a
//! steal that waited only for the copiers let a dropped clone's late reader see the new bytes:
//! `tests/lifecycle_handover.rs`). Materializing on a stream other than the one that was current
//! at lazy-clone time first waits for that stream.
//!
//! Inside a stream capture (`alloc/graph.rs`) a copier's copy is recorded into the graph — its
//! memory from the graph's pool — and runs at every replay, reading the source as it is then (the
//! source is an input of the graph: keep it alive while replaying). A stealer outside the capture
//! waits only for the capturing stream's work before the capture (the capture's tail event: its
//! copy runs only at replays, and a wait on the stream itself would join the capture); where that
//! work is unknown (a capture the allocator did not begin) the last reference copies instead of
//! stealing. `unordered_mutable_data_ptr()` does not wait for the copy (waiting is forbidden there; work
//! captured after it runs after it). Tested in `tests/graphs_meet.rs` and
//! `tests/lifecycle_handover.rs`.

pub mod cell;
mod context;

pub(crate) use context::{is_cow, lazy_clone, materialize};
