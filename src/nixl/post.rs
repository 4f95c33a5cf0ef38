//! Posting transfers: [`NixlAgent::write`] and [`NixlAgent::read`] — the pairing of local and
//! remote regions into NIXL descriptors, the checks before NIXL sees them, the host ordering and
//! the sanitizer's view (`transfer.rs`), and what keeps the local memory in place until the end.

use nixl_sys::{OptArgs, XferDescList, XferOp};

use super::agent::NixlAgent;
use super::core::nixl_error;
use super::descriptor::{pair, RemoteStorage};
use super::transfer::{touches, Transfer};
use crate::driver::StreamId;
use crate::error::{Error, ErrorKind, Result};
use crate::storage::Storage;
use crate::sync::os::Arc;

use super::descriptor::mem_type;

impl NixlAgent {
    /// Writes each local storage into the remote storage paired with it (equal sizes), after the
    /// work queued on `stream` so far; `notify` is delivered to the peer once every byte landed.
    /// The local memory stays in place and alive until the transfer ends, whatever the storages
    /// go through meanwhile (a written lazy clone moves, a dropped storage frees: not under NIXL).
    pub fn write(
        &self,
        stream: StreamId,
        pairs: &[(&Storage, &RemoteStorage)],
        notify: Option<&[u8]>,
    ) -> Result<Transfer> {
        self.post(XferOp::Write, stream, pairs, notify)
    }

    /// Reads each remote storage into the local storage paired with it (equal sizes; a lazy clone
    /// is materialized first), after the work queued on `stream` so far; `notify` tells the peer
    /// once the read is done.
    pub fn read(
        &self,
        stream: StreamId,
        pairs: &[(&Storage, &RemoteStorage)],
        notify: Option<&[u8]>,
    ) -> Result<Transfer> {
        self.post(XferOp::Read, stream, pairs, notify)
    }

    fn post(
        &self,
        op: XferOp,
        stream: StreamId,
        pairs: &[(&Storage, &RemoteStorage)],
        notify: Option<&[u8]>,
    ) -> Result<Transfer> {
        let what = match op {
            XferOp::Write => "a NIXL write",
            XferOp::Read => "a NIXL read",
        };
        self.core.alive()?;
        let Some(first) = pairs.first().map(|p| p.1) else {
            return Err(Error::invalid(format!("{what} of no storage")));
        };
        let peer = first.agent().to_owned();
        let core = &self.core;
        let device = core.runtime.driver().stream_device(stream)?;
        let mut local =
            XferDescList::new(core.registrar.mem_type()).map_err(|e| nixl_error(what, e))?;
        let mut remote =
            XferDescList::new(mem_type(first.kind())).map_err(|e| nixl_error(what, e))?;
        let mut ranges = Vec::new();
        let mut bytes = 0u64;
        let mut generation = 0;
        let mut pins = Vec::new();
        for (storage, target) in pairs {
            if target.agent() != peer || target.kind() != first.kind() {
                return Err(Error::invalid(format!(
                    "{what} names storages of {peer} ({:?}) and of {} ({:?}): one transfer, one \
                     peer and one memory kind",
                    first.kind(),
                    target.agent(),
                    target.kind()
                )));
            }
            if storage.device() != device {
                return Err(Error::invalid(format!(
                    "{what} on a stream of device {device} with a storage on device {}",
                    storage.device()
                )));
            }
            let pieces = match op {
                XferOp::Write => storage.registered_regions()?,
                XferOp::Read => storage.registered_regions_mut()?,
            };
            // The memory as it is now stays put until the transfer ends (`Storage::pin_memory`).
            pins.extend(storage.pin_memory()?);
            let mine: Vec<(u64, u64)> = pieces.iter().map(|p| (p.addr().0, p.len)).collect();
            for (l, r, len) in pair(&mine, target.pieces())? {
                local.add_desc(l as usize, len as usize, core.registrar.device_id(device));
                remote.add_desc(r as usize, len as usize, target.device());
            }
            bytes += storage.nbytes();
            generation = generation.max(target.generation());
            ranges.extend(mine);
        }
        let mut args = OptArgs::new().map_err(|e| nixl_error(what, e))?;
        if let Some(message) = notify {
            args.set_notification_message(message)
                .and_then(|()| args.set_has_notification(true))
                .map_err(|e| nixl_error(what, e))?;
        }
        core.peers.begin(&peer, generation, what)?;
        let mut transfer = Transfer {
            core: Arc::clone(core),
            request: None,
            local: pairs.iter().map(|p| p.0.clone()).collect(),
            pins,
            actor: None,
            peer: peer.clone(),
            what,
            bytes,
            done: false,
        };
        let request = core
            .agent
            .create_xfer_req(op, &local, &remote, &peer, Some(&args))
            .map_err(|e| {
                transfer.complete();
                nixl_error(
                    &format!(
                        "{what} of {bytes} bytes with {peer} (a descriptor outside memory \
                         registered on either side)"
                    ),
                    e,
                )
            })?;
        // Real order: the stream's work so far is done before NIXL touches the bytes.
        if let Err(err) = core.runtime.driver().stream_synchronize(stream) {
            transfer.complete();
            return Err(err);
        }
        let post = || {
            core.agent
                .post_xfer_req(&request, None)
                .map_err(|e| nixl_error(&format!("posting {what} with {peer}"), e))
        };
        let posted = match &self.actors {
            None => post().map(drop),
            Some(actors) => actors.take(device).and_then(|actor| {
                actors.sanitizer.stream_waited(actor, stream);
                let touched = touches(&ranges, matches!(op, XferOp::Read));
                match actors.sanitizer.enqueue(actor, what, &touched, post) {
                    Ok(_) => {
                        transfer.actor = Some((Arc::clone(actors), actor));
                        Ok(())
                    }
                    Err(err) => {
                        if err.kind() == ErrorKind::StreamRace {
                            actors.discard(actor);
                        } else {
                            actors.finish(actor);
                        }
                        Err(err)
                    }
                }
            }),
        };
        // Posted or not, the request is the transfer's: a failed post leaves nothing in flight.
        transfer.request = Some(request);
        if let Err(err) = posted {
            transfer.complete();
            return Err(err);
        }
        Ok(transfer)
    }
}
