//! [`NixlAgent`]: a runtime's NIXL agent — its registrar attached to the allocator, the peers whose
//! metadata it loaded, storages described for peers, transfers and notifications.

use std::mem::ManuallyDrop;
use std::time::{Duration, Instant};

use nixl_sys::{Agent, AgentConfig, MemType, NotificationMap, ThreadSync};

use super::core::{nixl_error, Core};
use super::descriptor::{MemoryKind, RemoteStorage, MAX_AGENT_NAME};
use super::peers::{self, Peers};
use super::registrar::NixlRegistrar;
use super::transfer::{backoff, touches, Actors};
use crate::alloc::OnRegistrationFailure;
use crate::driver::{Backend, StreamId};
use crate::error::{Error, Result};
use crate::process::Birth;
use crate::runtime::Runtime;
use crate::storage::Storage;
use crate::sync::os::{Arc, Mutex};

/// Largest peer metadata accepted (1,000 registered regions take about 44 KB).
pub const MAX_METADATA_BYTES: usize = 16 << 20;
/// Most notifications kept unread; past it the oldest are dropped (and counted).
pub const MAX_PENDING_NOTIFICATIONS: usize = 65_536;

/// Options of a [`NixlAgent`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct NixlOptions {
    /// The agent's name, unique among the agents that talk to each other.
    pub name: String,
    /// What a failed registration of a new segment does (default: fails its allocation).
    pub on_failure: OnRegistrationFailure,
    /// How long NIXL's progress thread sleeps between polls, in µs. 0 spins a core; the default
    /// (1,000) costs little CPU and still completes transfers and notifications promptly.
    pub progress_delay_us: u64,
    /// NIXL's metadata listener on this TCP port (NIXL's socket exchange:
    /// [`NixlAgent::send_metadata`], [`NixlAgent::fetch_peer`], [`NixlAgent::await_peer`], and a
    /// Python peer's `send_local_metadata` / `fetch_remote_metadata`); `None` (the default): no
    /// listener.
    ///
    /// **Trust.** NIXL's listener binds every interface and authenticates no one: whoever
    /// reaches the port gets this agent's metadata — the keys to every registered region, the
    /// whole cached pool, not only what was offered — and can load metadata into it (bytes NIXL
    /// parses without cudalloc's checks). Listen only on a network where every host is trusted
    /// (or the port is firewalled to them).
    pub listen_port: Option<u16>,
}

impl NixlOptions {
    /// Options for an agent named `name`.
    pub fn new(name: impl Into<String>) -> Self {
        NixlOptions {
            name: name.into(),
            on_failure: OnRegistrationFailure::FailAllocation,
            progress_delay_us: 1_000,
            listen_port: None,
        }
    }

    /// Runs NIXL's metadata listener on TCP `port` (see [`NixlOptions::listen_port`]).
    pub fn listen(mut self, port: u16) -> Self {
        self.listen_port = Some(port);
        self
    }

    /// Sets what a failed registration does.
    pub fn on_failure(mut self, on_failure: OnRegistrationFailure) -> Self {
        self.on_failure = on_failure;
        self
    }

    /// Sets the progress thread's sleep between polls.
    pub fn progress_delay_us(mut self, us: u64) -> Self {
        self.progress_delay_us = us;
        self
    }
}

/// A message a peer attached to its transfer (or sent alone).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Notification {
    /// The peer agent's name.
    pub from: String,
    /// Its bytes.
    pub message: Vec<u8>,
}

/// A runtime's NIXL agent over UCX (see the module docs of [`crate::nixl`]).
pub struct NixlAgent {
    pub(crate) core: Arc<Core>,
    name: String,
    pending: Mutex<Vec<Notification>>,
    pub(super) offers: super::core::Offers,
    pub(super) offer_counts: Mutex<super::core::OfferCounts>,
    pub(crate) actors: Option<Arc<Actors>>,
}

impl std::fmt::Debug for NixlAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlAgent")
            .field("name", &self.name)
            .field("registered", &self.core.registrar.registered())
            .field("peers", &self.core.peers.len())
            .finish()
    }
}

impl NixlAgent {
    /// Creates the agent and its UCX backend, and attaches its registrar to `runtime`'s allocator:
    /// every segment mapped so far is registered now, every later one as it is mapped. Fails with
    /// [`Error::Transfer`] when NIXL's library cannot be loaded ([`load_library`](super::load_library)) or UCX
    /// cannot start.
    pub fn new(runtime: &Arc<Runtime>, options: NixlOptions) -> Result<Self> {
        super::library::load_library(None)?;
        if options.name.is_empty() || options.name.len() > MAX_AGENT_NAME {
            return Err(Error::invalid(format!(
                "a NIXL agent name of {} bytes (1 to {})",
                options.name.len(),
                MAX_AGENT_NAME
            )));
        }
        let mem_type = match runtime.driver().backend() {
            Backend::Host => MemType::Dram,
            Backend::Cuda => MemType::Vram,
            other => {
                return Err(Error::invalid(format!(
                    "NIXL transfers need real memory; the {other:?} backend backs none"
                )))
            }
        };
        let config = AgentConfig {
            enable_prog_thread: true,
            enable_listen_thread: options.listen_port.is_some(),
            listen_port: options.listen_port.map_or(0, i32::from),
            thread_sync: ThreadSync::Rw,
            pthr_delay_us: options.progress_delay_us,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(&options.name, &config)
            .map_err(|e| nixl_error("creating the agent", e))?;
        let (_memories, params) = agent.get_plugin_params("UCX").map_err(|e| {
            nixl_error(
                "NIXL's UCX plugin (is its plugins folder beside the library?)",
                e,
            )
        })?;
        agent
            .create_backend("UCX", &params)
            .map_err(|e| nixl_error("starting the UCX backend", e))?;
        let registrar = Arc::new(NixlRegistrar::new(agent.clone(), mem_type));
        let registrar_id = runtime
            .allocator()
            .attach_registrar(registrar.clone(), options.on_failure)?;
        let driver = runtime.driver();
        let actors = driver.sanitizer().map(|sanitizer| {
            Arc::new(Actors {
                birth: Birth::now(),
                sanitizer,
                driver: Arc::clone(driver),
                free: Mutex::new(Vec::new()),
                all: Mutex::new(Vec::new()),
            })
        });
        Ok(NixlAgent {
            core: Arc::new(Core {
                runtime: Arc::clone(runtime),
                agent: ManuallyDrop::new(agent),
                registrar,
                registrar_id,
                peers: Peers::default(),
                birth: Birth::now(),
            }),
            name: options.name,
            pending: Mutex::new(Vec::new()),
            offers: Default::default(),
            offer_counts: Mutex::new(Default::default()),
            actors,
        })
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The runtime whose memory it registers.
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.core.runtime
    }

    /// Regions registered with this agent now; 0 in a forked child (the registrations are the
    /// parent's, and their list's lock may have been held by a parent thread at the fork).
    pub fn registered_regions(&self) -> usize {
        if self.core.alive().is_err() {
            return 0;
        }
        self.core.registrar.registered()
    }

    /// The registration generation: bumped by every registration and deregistration. Metadata
    /// sent at an older generation than a description's makes peers refuse the description (with
    /// an error that says so): after describing storages in new segments, or after segments were
    /// freed, send [`metadata`](Self::metadata) again.
    pub fn generation(&self) -> u64 {
        self.core.registrar.generation()
    }

    /// This agent's metadata (its registrations and how to reach it, in cudalloc's envelope
    /// with the generation; `peers.rs`), for peers' [`load_peer`](Self::load_peer): send it over
    /// any byte channel.
    pub fn metadata(&self) -> Result<Vec<u8>> {
        self.core.alive()?;
        let generation = self.generation();
        let nixl = self
            .core
            .agent
            .get_local_md()
            .map_err(|e| nixl_error("reading this agent's metadata", e))?;
        Ok(peers::seal(generation, &nixl))
    }

    /// This agent's metadata in NIXL's own form (`get_local_md`, what the Python API's
    /// `add_remote_agent` takes), for a peer that is not cudalloc. Without cudalloc's envelope a
    /// peer cannot tell stale metadata from fresh: send it again after segments were freed.
    pub fn nixl_metadata(&self) -> Result<Vec<u8>> {
        self.core.alive()?;
        self.core
            .agent
            .get_local_md()
            .map_err(|e| nixl_error("reading this agent's metadata", e))
    }

    /// Loads a peer's metadata — a cudalloc agent's [`metadata`](Self::metadata), or NIXL's own
    /// (`get_agent_metadata` of a foreign peer) — replacing what was loaded of it before, and
    /// returns its name.
    /// The bytes are untrusted: checked before NIXL parses them (`peers.rs`). Refused while
    /// transfers with that peer are in flight.
    pub fn load_peer(&self, metadata: &[u8]) -> Result<String> {
        self.core.alive()?;
        let (generation, nixl, name) = peers::open(metadata, MAX_METADATA_BYTES)?;
        if name == self.name {
            return Err(Error::transfer(format!(
                "peer metadata names this agent ({name})"
            )));
        }
        self.core.peers.may_replace(&name)?;
        let agent = &self.core.agent;
        if self.core.peers.forget(&name) {
            // NIXL keeps the first copy of a peer's metadata: drop it, then load the new one.
            if let Err(err) = agent.invalidate_remote_md(&name) {
                tracing::warn!(%err, peer = %name, "dropping a peer's old metadata before a reload failed");
            }
        }
        let load = || agent.load_remote_md(nixl);
        // The name was checked above; should nixl-sys still panic, that is bad input too.
        let loaded = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(load)) {
            Ok(Ok(loaded)) => loaded,
            Ok(Err(err)) => return Err(nixl_error("loading a peer's metadata", err)),
            Err(_) => return Err(Error::transfer("NIXL could not read the peer's metadata")),
        };
        if loaded != name {
            if let Err(err) = agent.invalidate_remote_md(&loaded) {
                tracing::warn!(%err, peer = %loaded, "dropping metadata loaded under the wrong name failed");
            }
            return Err(Error::transfer(format!(
                "peer metadata names {name:?} but NIXL read {loaded:?}"
            )));
        }
        self.core.peers.loaded(&name, generation);
        Ok(name)
    }

    /// Sends this agent's metadata, NIXL's own form, to the NIXL listener at `ip:port` (a peer's
    /// [`NixlOptions::listen`], or a Python agent's `enable_listen_thread`): NIXL's socket
    /// exchange. The peer then knows this agent without any other channel.
    pub fn send_metadata(&self, ip: &str, port: u16) -> Result<()> {
        self.core.alive()?;
        let args = listener_args(ip, port)?;
        self.core
            .agent
            .send_local_md(Some(&args))
            .map_err(|e| nixl_error(&format!("sending this agent's metadata to {ip}:{port}"), e))
    }

    /// Asks the NIXL listener at `ip:port` for agent `peer`'s metadata and waits at most
    /// `timeout` for it to arrive (NIXL loads it; generation 0, as a foreign peer's). Returns the
    /// peer's name.
    pub fn fetch_peer(&self, peer: &str, ip: &str, port: u16, timeout: Duration) -> Result<String> {
        self.core.alive()?;
        self.check_peer_name(peer)?;
        self.core.peers.may_replace(peer)?;
        let args = listener_args(ip, port)?;
        self.core
            .agent
            .fetch_remote_md(peer, Some(&args))
            .map_err(|e| nixl_error(&format!("asking {ip}:{port} for {peer}'s metadata"), e))?;
        self.await_peer(peer, timeout)
    }

    /// Waits at most `timeout` for agent `peer`'s metadata to reach this agent's listener (the
    /// peer sent it: its `send_local_metadata`, or [`NixlAgent::send_metadata`]); then transfers
    /// with it are allowed (generation 0). Returns the peer's name.
    pub fn await_peer(&self, peer: &str, timeout: Duration) -> Result<String> {
        self.core.alive()?;
        self.check_peer_name(peer)?;
        let deadline = Instant::now() + timeout;
        while !self.core.agent.check_remote_metadata(peer, None) {
            if Instant::now() >= deadline {
                return Err(Error::transfer(format!(
                    "{peer}'s metadata did not reach this agent's listener within {timeout:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        // A peer known already (its envelope loaded) keeps its generation and transfers.
        self.core.peers.learn(peer);
        Ok(peer.to_owned())
    }

    fn check_peer_name(&self, peer: &str) -> Result<()> {
        if peer.is_empty() || peer.len() > MAX_AGENT_NAME || peer == self.name {
            return Err(Error::invalid(format!("a peer agent named {peer:?}")));
        }
        Ok(())
    }

    /// Waits at most `timeout` until the metadata this agent holds of `remote`'s owner covers
    /// every piece of `remote` (metadata sent by a listener arrives asynchronously: a peer's new
    /// registration is unknown here until it does).
    pub fn await_description(&self, remote: &RemoteStorage, timeout: Duration) -> Result<()> {
        self.core.alive()?;
        let what = "describing a remote storage to NIXL";
        let mut descs = nixl_sys::XferDescList::new(super::descriptor::mem_type(remote.kind()))
            .map_err(|e| nixl_error(what, e))?;
        for &(addr, len) in remote.pieces() {
            descs.add_desc(addr as usize, len as usize, remote.device());
        }
        let deadline = Instant::now() + timeout;
        while !self
            .core
            .agent
            .check_remote_metadata(remote.agent(), Some(&descs))
        {
            if Instant::now() >= deadline {
                return Err(Error::transfer(format!(
                    "{}'s metadata did not cover the described storage within {timeout:?}",
                    remote.agent()
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// Forgets a peer's metadata (transfers with it are refused until it is loaded again).
    /// Refused while transfers with it are in flight.
    pub fn forget_peer(&self, peer: &str) -> Result<()> {
        self.core.alive()?;
        self.core.peers.may_replace(peer)?;
        if !self.core.peers.forget(peer) {
            return Err(Error::transfer(format!("{peer} is not a loaded peer")));
        }
        self.core
            .agent
            .invalidate_remote_md(peer)
            .map_err(|e| nixl_error("forgetting a peer", e))
    }

    /// Describes `storage` for a peer's transfers: its regions' address ranges under this agent.
    /// `stream` is where its last work was queued: it is synchronized first, so a peer's transfer
    /// comes after that work. The owner keeps the storage alive while peers may use the
    /// description. A lazy clone is materialized (a peer may write it).
    pub fn describe(&self, storage: &Storage, stream: StreamId) -> Result<RemoteStorage> {
        self.core.alive()?;
        let regions = storage.registered_regions_mut()?;
        for piece in &regions {
            if !self.core.registrar.holds(piece.region.id) {
                return Err(Error::transfer(format!(
                    "{} is not registered with NIXL (its registration failed and was skipped)",
                    piece.region.id
                )));
            }
        }
        self.core.runtime.driver().stream_synchronize(stream)?;
        let kind = match self.core.registrar.mem_type() {
            MemType::Vram => MemoryKind::Vram,
            _ => MemoryKind::Dram,
        };
        Ok(RemoteStorage::new(
            self.name.clone(),
            kind,
            self.core.registrar.device_id(storage.device()),
            regions.iter().map(|p| (p.addr().0, p.len)).collect(),
        )?
        .with_generation(self.generation()))
    }

    /// Sends `message` to `peer` alone (no transfer).
    pub fn notify(&self, peer: &str, message: &[u8]) -> Result<()> {
        self.core.alive()?;
        self.core
            .agent
            .send_notification(peer, message, None)
            .map_err(|e| nixl_error(&format!("notifying {peer}"), e))
    }

    /// Every notification that arrived since the last call (and those kept by
    /// [`wait_notification`](Self::wait_notification)), oldest first.
    pub fn notifications(&self) -> Result<Vec<Notification>> {
        self.fetch()?;
        Ok(std::mem::take(&mut *self.pending.lock()))
    }

    /// Waits at most `timeout` for the notification `message` from `from`, keeping the others
    /// for later calls.
    pub fn wait_notification(&self, from: &str, message: &[u8], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut spins = 0;
        loop {
            self.fetch()?;
            {
                let mut pending = self.pending.lock();
                if let Some(at) = pending
                    .iter()
                    .position(|n| n.from == from && n.message == message)
                {
                    pending.remove(at);
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                return Err(Error::transfer(format!(
                    "no notification {:?} from {from} within {timeout:?}",
                    String::from_utf8_lossy(message)
                )));
            }
            backoff(&mut spins);
        }
    }

    /// Fetches notifications (releases of offers go to the offers' queue, `offers.rs`).
    pub(super) fn fetch(&self) -> Result<()> {
        self.core.alive()?;
        let mut map = NotificationMap::new().map_err(|e| nixl_error("notifications", e))?;
        self.core
            .agent
            .get_notifications(&mut map, None)
            .map_err(|e| nixl_error("reading notifications", e))?;
        let mut fresh = Vec::new();
        let agents: Vec<String> = map
            .agents()
            .filter_map(|a| a.ok().map(str::to_owned))
            .collect();
        for from in agents {
            let count = map.get_notifications_size(&from).unwrap_or(0);
            for i in 0..count {
                if let Ok(message) = map.get_notification_bytes(&from, i) {
                    fresh.push(Notification {
                        from: from.clone(),
                        message,
                    });
                }
            }
        }
        // Releases of offers go to the offers' queue (bounded like the notifications).
        let (releases, fresh): (Vec<_>, Vec<_>) = fresh
            .into_iter()
            .partition(|n| super::core::release_id(&n.message).is_some());
        if !releases.is_empty() {
            let mut queue = self.offers.releases.lock();
            queue.extend(
                releases
                    .into_iter()
                    .filter_map(|n| super::core::release_id(&n.message).map(|id| (n.from, id))),
            );
            if queue.len() > MAX_PENDING_NOTIFICATIONS {
                let extra = queue.len() - MAX_PENDING_NOTIFICATIONS;
                queue.drain(..extra);
                tracing::warn!(
                    extra,
                    "release notifications dropped (a peer sends more than offers exist)"
                );
            }
        }
        let mut pending = self.pending.lock();
        pending.extend(fresh);
        if pending.len() > MAX_PENDING_NOTIFICATIONS {
            let extra = pending.len() - MAX_PENDING_NOTIFICATIONS;
            pending.drain(..extra);
            tracing::warn!(
                extra,
                "unread NIXL notifications dropped (a peer sends more than is read)"
            );
        }
        Ok(())
    }

    /// Tells the stream sanitizer (when on) that a peer's transfer wrote `storage` and that the
    /// host learned it (by a notification): work queued on `stream` from now on is ordered after
    /// it, and other streams must wait for `stream`. Without the sanitizer it does nothing.
    pub fn received(&self, storage: &Storage, stream: StreamId) -> Result<()> {
        self.core.alive()?;
        let Some(actors) = &self.actors else {
            return Ok(());
        };
        let ranges: Vec<(u64, u64)> = storage
            .registered_regions()?
            .iter()
            .map(|p| (p.addr().0, p.len))
            .collect();
        let actor = actors.take(storage.device())?;
        let outcome = actors.sanitizer.enqueue(
            actor,
            "a NIXL transfer from a peer",
            &touches(&ranges, true),
            || Ok(()),
        );
        if let Err(err) = outcome {
            actors.discard(actor);
            return Err(err);
        }
        actors.sanitizer.stream_waited(stream, actor);
        actors.finish(actor);
        Ok(())
    }
}

/// NIXL's optional arguments naming a listener (`ip` must be an IP address: nixl-sys would
/// panic on an interior NUL).
fn listener_args(ip: &str, port: u16) -> Result<nixl_sys::OptArgs> {
    let ip: std::net::IpAddr = ip
        .parse()
        .map_err(|_| Error::invalid(format!("{ip:?} is not an IP address")))?;
    let bad = |e| nixl_error("building the listener's address", e);
    let mut args = nixl_sys::OptArgs::new().map_err(bad)?;
    args.set_ip_addr(&ip.to_string()).map_err(bad)?;
    args.set_port(port).map_err(bad)?;
    Ok(args)
}
