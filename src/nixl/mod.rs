//! Transfers beyond one process or machine through NVIDIA's NIXL (over UCX), with the allocator's
//! memory registered once per segment (feature `nixl`).
//!
//! A [`NixlAgent`] belongs to a [`Runtime`](crate::Runtime): it attaches a registrar to the
//! runtime's allocator (`alloc/registration.rs`), so every region the allocator maps is registered
//! with NIXL once — DRAM on the host backend (its device memory is real shared memory), VRAM on
//! CUDA — and deregistered before its memory goes. A storage's transfer descriptor is then its
//! region's registration plus an offset: no registration per tensor, ever.
//!
//! The files, from the ground up: `library.rs` (loading `libnixl_capi.so` and proving it is not
//! nixl-sys's aborting stub), `descriptor.rs` ([`RemoteStorage`], its checked encoding, pairing
//! local and remote regions), `foreign.rs` (NIXL's own forms of a descriptor list, bare and as its Python API
//! pickles them, for peers that are not cudalloc), `core.rs` (what an agent and its transfers share), `peers.rs` (the metadata envelope, checks on a peer's bytes before
//! NIXL parses them, what is known of each peer), `registrar.rs` (the registrar), `transfer.rs`
//! ([`Transfer`] and the stream sanitizer's view of it), `agent.rs` ([`NixlAgent`]: set-up,
//! metadata, descriptions, notifications), `post.rs` (writes and reads), `offers.rs` (storages held
//! for peers until they release them: a foreign peer's lease).
//!
//! The protocol between two agents, over any byte channel:
//!
//! | step | owner of the storage | the other side |
//! |---|---|---|
//! | meet | sends [`NixlAgent::metadata`] | [`NixlAgent::load_peer`] |
//! | offer | [`NixlAgent::describe`] (after its stream's work) and sends [`RemoteStorage::to_bytes`], and its metadata again if its [`generation`](NixlAgent::generation) moved since it last sent it; keeps the storage alive | [`RemoteStorage::from_bytes`] (untrusted input, checked); [`NixlAgent::load_peer`] with the fresh metadata (a description newer than the metadata loaded is refused with an error that says so) |
//! | move | — | [`NixlAgent::write`] / [`NixlAgent::read`] on a stream, with a notification; [`Transfer::wait`] |
//! | learn | [`NixlAgent::wait_notification`], then [`NixlAgent::received`] orders its stream after the bytes | — |
//! | free | drops the storage; once its segment is released (deregistered first), sends fresh metadata | [`NixlAgent::load_peer`] again: NIXL then refuses transfers into the freed memory |
//!
//! **A peer that is not cudalloc** speaks NIXL's own forms (`foreign.rs`): it loads
//! [`NixlAgent::nixl_metadata`] (NIXL's `get_local_md`; no envelope, so no generation: send it
//! again after segments were freed), reads [`RemoteStorage::to_nixl_descs`] with its Python API's
//! `deserialize_descs`, and sends its own `get_agent_metadata` and `get_serialized_descs` bytes,
//! which [`NixlAgent::load_peer`] and [`RemoteStorage::from_nixl_descs`] read (generation 0).
//! Metadata may instead go by NIXL's listeners ([`NixlOptions::listen`],
//! [`NixlAgent::send_metadata`], [`NixlAgent::fetch_peer`], [`NixlAgent::await_peer`]); it then
//! arrives asynchronously, and [`NixlAgent::await_description`] waits until it covers a storage.
//! A storage for a foreign peer is offered ([`NixlAgent::offer`], `offers.rs`): held allocated
//! until that peer's release notification or a time to live (applied by
//! [`NixlAgent::collect_offers`]), so the peer does not meet a later owner's bytes at the same
//! address while it holds its lease. NIXL itself refuses only descriptors outside *all* memory the
//! owner registered (its whole cached pool), not outside the offered storage: a peer holding the
//! metadata is trusted with the pool.
//! cudalloc's own description encoding stays for cudalloc peers: it carries the owner's
//! registration generation, which NIXL's lists do not, and so turns a stale peer's transfer into a
//! clear error instead of NIXL's "no backend had the required registrations".
//!
//! **What NIXL does and does not check.** NIXL refuses a descriptor outside memory registered on
//! either side, as it knows the peer's registrations from the last metadata it loaded. A peer that
//! still holds *stale* metadata can still target memory the owner has deregistered (UCX moves the
//! bytes while the memory is mapped, and over its tcp transport a write into memory the owner
//! unmapped can crash the owner). So an owner keeps a storage alive while peers may target it, as
//! with IPC handles, and sends fresh metadata after freeing; peers reload it before they transfer.
//!
//! **Streams.** NIXL has no streams; a transfer is ordered by the host around it (see
//! `transfer.rs`), and is an access the stream sanitizer checks.

mod agent;
mod core;
mod descriptor;
mod foreign;
mod library;
mod offers;
mod peers;
mod post;
mod registrar;
mod transfer;

pub use agent::{
    NixlAgent, NixlOptions, Notification, MAX_METADATA_BYTES, MAX_PENDING_NOTIFICATIONS,
};
pub use core::{OfferCounts, RELEASE_PREFIX};
pub use descriptor::{MemoryKind, RemoteStorage, MAX_AGENT_NAME, MAX_PIECES};
pub use library::{load_library, NixlLibrary, NIXL_LIB_DIR_VAR};
pub use offers::MAX_OFFERS;
pub use transfer::{Transfer, DROP_DEADLINE};
