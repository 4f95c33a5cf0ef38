//! [`Core`]: what a [`NixlAgent`](super::NixlAgent) and its transfers share, NIXL's errors as
//! cudalloc's, and the state of an agent's offers (`offers.rs`).

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::time::Instant;

use nixl_sys::Agent;

use super::peers::Peers;
use super::registrar::NixlRegistrar;
use crate::alloc::RegistrarId;
use crate::error::Error;
use crate::process::Birth;
use crate::runtime::Runtime;
use crate::storage::Storage;
use crate::sync::os::{Arc, Mutex};

/// What an agent and its transfers share: the NIXL agent, its registrar's attachment and what is
/// known of peers. Its last holder detaches the registrar, so no region is deregistered under a
/// transfer that outlived its [`NixlAgent`].
pub(crate) struct Core {
    pub runtime: Arc<Runtime>,
    pub agent: ManuallyDrop<Agent>,
    pub registrar: Arc<NixlRegistrar>,
    pub registrar_id: RegistrarId,
    pub peers: Peers,
    pub birth: Birth,
}

impl Drop for Core {
    fn drop(&mut self) {
        if !self.birth.is_current() {
            // A forked child's copy: NIXL's threads and connections are the parent's; calling into
            // it here could hang. The agent and the registrar (whose handles would deregister) are
            // left alone; the child's registry never frees the parent's memory either.
            std::mem::forget(Arc::clone(&self.registrar));
            return;
        }
        self.runtime.allocator().detach_registrar(self.registrar_id);
        // SAFETY: dropped once, here, and never used again (this is the core's own drop).
        unsafe { ManuallyDrop::drop(&mut self.agent) };
    }
}

impl Core {
    /// An error in a forked child: NIXL's threads and connections are the parent's, so a child
    /// never calls into the agent it inherited.
    pub(crate) fn alive(&self) -> crate::error::Result<()> {
        self.birth.check("this NIXL agent")
    }
}

/// NIXL's error as a transfer error saying what was being done.
pub(crate) fn nixl_error(what: &str, err: nixl_sys::NixlError) -> Error {
    Error::transfer(format!("{what}: NIXL said {err}"))
}

#[derive(Debug)]
pub(crate) struct Offered {
    /// The storage (the program's handle may be gone).
    pub(super) _storage: Storage,
    /// Its memory as it was offered: a lazy clone materialized later moves the storage, not
    /// the offered bytes, which this keeps (`Storage::pin_memory`).
    pub(super) _pinned: Option<Storage>,
    /// The only peer whose release counts.
    pub(super) peer: String,
    pub(super) until: Instant,
}

/// A peer's release of offer `id` is the notification `RELEASE_PREFIX` followed by `id` in
/// decimal digits (`cudalloc-release:42`).
pub const RELEASE_PREFIX: &[u8] = b"cudalloc-release:";

/// The offer id in a release notification, if `message` is one (decimal digits only).
pub(crate) fn release_id(message: &[u8]) -> Option<u64> {
    let digits = message.strip_prefix(RELEASE_PREFIX)?;
    if digits.is_empty() || digits.len() > 20 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

/// An agent's offers (`offers.rs`).
#[derive(Debug, Default)]
pub(crate) struct Offers {
    pub(super) held: Mutex<HashMap<u64, Offered>>,
    pub(super) next: Mutex<u64>,
    /// Releases (peer, id) taken out of the notifications as they are fetched, so the program's
    /// own reads of notifications never swallow one.
    pub(super) releases: Mutex<Vec<(String, u64)>>,
}

/// What an agent's offers came to ([`NixlAgent::collect_offers`](super::NixlAgent::collect_offers)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OfferCounts {
    /// Held now.
    pub held: usize,
    /// Released by a peer's notification since the agent was made.
    pub released: u64,
    /// Release notifications refused: for no offer held, or from a peer the offer was not made
    /// to.
    pub refused: u64,
    /// Expired (their time to live passed) since the agent was made.
    pub expired: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_ids_are_decimal_digits_only() {
        assert_eq!(release_id(b"cudalloc-release:42"), Some(42));
        for bad in [
            &b"cudalloc-release:"[..],
            b"cudalloc-release:+7",
            b"cudalloc-release:-7",
            b"cudalloc-release: 7",
            b"cudalloc-release:99999999999999999999999",
            b"write-done",
        ] {
            assert_eq!(release_id(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }
}
