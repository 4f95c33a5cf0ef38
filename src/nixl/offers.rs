//! Offers: storages held alive for peers that may still target them — the foreign peer's lease.
//!
//! NIXL cannot tell a stale descriptor from a fresh one while the memory stays registered: a
//! storage freed inside a segment that stays cached is handed out again at the same address, and a
//! peer still holding its descriptors would read (or write) the later owner's bytes. cudalloc
//! peers learn of deregistered segments by the metadata's generation, but not of a block reused
//! inside a registered segment; foreign peers learn nothing. So an owner *offers* a storage
//! ([`NixlAgent::offer`]): the agent keeps a clone of it — its memory is not freed — until the
//! peer says it is done, with a notification [`RELEASE_PREFIX`] followed by the offer's id
//! (any NIXL peer can send one: the Python API's `send_notif`), or until the offer's time to live
//! passes (a peer that died never says it). [`NixlAgent::collect_offers`] applies releases and
//! expiries; every offer, release and expiry is counted.
//!
//! | offer state | memory | left by |
//! |---|---|---|
//! | held | the agent's clone keeps it allocated, at its address | the holder's release notification, the time to live, the agent's drop |
//! | released / expired | freed when the program's own handles are gone | — |
//!
//! A peer that transfers after its release, or after the time to live, may meet a later owner's
//! bytes: that is the contract, as with an IPC handle's time to live.

use std::time::{Duration, Instant};

use super::agent::NixlAgent;
use std::hash::BuildHasher;

use super::core::{OfferCounts, Offered};
use super::descriptor::RemoteStorage;
use crate::driver::StreamId;
use crate::error::{Error, Result};
use crate::storage::Storage;

/// Most offers an agent holds at once.
pub const MAX_OFFERS: usize = 1 << 20;

impl NixlAgent {
    /// Offers `storage` to `peer`: its description ([`NixlAgent::describe`], after `stream`'s
    /// work) and an id no peer can guess, with the storage's memory kept allocated (as it is now:
    /// a lazy clone written later moves the storage, not these bytes) until `peer` sends the
    /// release notification for that id or `ttl` passes ([`NixlAgent::collect_offers`]).
    pub fn offer(
        &self,
        storage: &Storage,
        stream: StreamId,
        peer: &str,
        ttl: Duration,
    ) -> Result<(u64, RemoteStorage)> {
        let description = self.describe(storage, stream)?;
        let pinned = storage.pin_memory()?;
        let until = Instant::now()
            .checked_add(ttl)
            .ok_or_else(|| Error::invalid(format!("an offer's time to live of {ttl:?}")))?;
        let offers = &self.offers;
        let mut held = offers.held.lock();
        if held.len() >= MAX_OFFERS {
            return Err(Error::transfer(format!(
                "{MAX_OFFERS} offers are held: collect released ones first"
            )));
        }
        // Ids no peer can guess (a hostile peer could otherwise release others' offers by
        // counting; NIXL's sender names are the sender's word).
        let id = {
            let mut next = offers.next.lock();
            *next += 1;
            std::collections::hash_map::RandomState::new().hash_one(*next)
        };
        held.insert(
            id,
            Offered {
                _storage: storage.clone(),
                _pinned: pinned,
                peer: peer.to_owned(),
                until,
            },
        );
        Ok((id, description))
    }

    /// Applies peers' release notifications (never among the notifications this agent returns:
    /// they are set aside as they arrive) and expiries; returns the counts. A release from a peer
    /// the offer was not made to, or for no offer held, is refused (counted). The released
    /// storages are freed once the program holds them no more.
    pub fn collect_offers(&self) -> Result<OfferCounts> {
        self.fetch()?;
        let releases = std::mem::take(&mut *self.offers.releases.lock());
        let now = Instant::now();
        let mut held = self.offers.held.lock();
        let mut counts = self.offer_counts.lock();
        for (from, id) in releases {
            match held.get(&id) {
                Some(o) if o.peer == from => {
                    held.remove(&id);
                    counts.released += 1;
                }
                _ => counts.refused += 1,
            }
        }
        let before = held.len();
        held.retain(|_, o| o.until > now);
        counts.expired += (before - held.len()) as u64;
        counts.held = held.len();
        Ok(*counts)
    }
}
