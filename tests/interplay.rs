//! The interplay test: a seeded, randomized run over the public API where the features meet —
//! two allocators in the producer process, several streams, a churn thread reusing freed memory,
//! lazy clones and their writes, sharing to several consumer processes, consumers writing back and
//! forwarding to each other, drops on both sides, `empty_cache`, `ipc_collect`, and consumers killed
//! with SIGKILL (and replaced). An oracle knows the pattern seed every live storage must hold and
//! checks it on both sides at every step; poison-on-free turns a use-after-free into a mismatch.
//! Where the features meet the streams: storages allocated in a memory pool or a tag, reads on
//! another stream (a late device copy and `record_stream`, lazy clones included) whose bytes are
//! checked once they ran — whatever the source did meanwhile (dropped, written, stolen back by its
//! clone) — and graphs captured into private pools, replayed on any stream, their outputs checked.
//!
//! ```text
//! cargo test --test interplay                          # a fresh seed, INTERPLAY_SECONDS (default 10)
//! cargo test --test interplay -- --seed 1234 --seconds 60
//! ```
//!
//! A failure prints the seed and the operation log; `--seed` replays the same operations (the
//! interleaving with the churn thread differs, which only adds coverage). Consumers are this binary
//! re-executed with `--consumer`. The producer forks data-loader-style workers (they drop every
//! inherited storage, empty the cache, try to allocate, build a runtime of their own) and so do the
//! consumers; afterwards every storage of the forking process is checked. One consumer runs in a
//! pid namespace of its own (`unshare --pid --fork`) where the machine allows it — the run says so,
//! or that it skipped the namespace and why.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{cuda_suite, hex, test_config, test_driver, unhex};
use cudalloc::{ipc::IpcHandle, Runtime, Storage, StreamId};

use common::rng::Rng;
use cudalloc::internals::pattern;

struct Consumer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// The consumer's pid in our namespace when it runs in its own pid namespace (under
    /// `unshare`, our child): killing it means killing that process.
    namespaced: Option<i32>,
}

/// Whether consumers can run in a pid namespace of their own: `Err` says why not.
fn pid_namespace_available() -> Result<(), String> {
    match Command::new("unshare")
        .args(["--pid", "--fork", "true"])
        .stderr(std::process::Stdio::piped())
        .output()
    {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(format!(
            "`unshare --pid --fork` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => Err(format!("`unshare` cannot run: {e}")),
    }
}

impl Consumer {
    fn spawn(namespaced: bool) -> Consumer {
        let exe = std::env::current_exe().unwrap();
        let mut command = if namespaced {
            let mut c = Command::new("unshare");
            c.args(["--pid", "--fork"]).arg(exe);
            c
        } else {
            Command::new(exe)
        };
        let (child, stdin, stdout) = common::spawn_piped(command.arg("--consumer"));
        let mut consumer = Consumer {
            child,
            stdin,
            stdout,
            namespaced: None,
        };
        if namespaced {
            // `/proc` is still our namespace's: the consumer's `/proc/self` names its pid here.
            let pid = consumer.ask("PID").unwrap();
            assert_eq!(
                consumer.ask("NSPID").unwrap(),
                "1",
                "not in a new pid namespace"
            );
            consumer.namespaced = Some(pid.parse().unwrap());
        }
        consumer
    }

    fn ask(&mut self, line: &str) -> Result<String, String> {
        writeln!(self.stdin, "{line}").map_err(|e| format!("consumer gone: {e}"))?;
        self.stdin.flush().map_err(|e| e.to_string())?;
        let mut reply = String::new();
        self.stdout
            .read_line(&mut reply)
            .map_err(|e| e.to_string())?;
        if reply.is_empty() {
            return Err("consumer exited".into());
        }
        Ok(reply.trim_end().to_owned())
    }

    fn kill(mut self) {
        match self.namespaced {
            // `unshare` waits for it: once `unshare` is reaped, the consumer is gone.
            // SAFETY: kill has no memory preconditions.
            Some(pid) => unsafe {
                libc::kill(pid, libc::SIGKILL);
            },
            None => {
                let _ = self.child.kill();
            }
        }
        let _ = self.child.wait();
    }
}

/// A producer-side storage and the seed its bytes must hold.
struct Live {
    storage: Storage,
    seed: u64,
    /// Consumers (by index) holding it.
    holders: Vec<usize>,
}

/// A copy of storage `source` enqueued on another stream, late (behind a sleep kernel), with
/// `record_stream`: `reader` must hold `seed`, the source's bytes when the copy was enqueued.
struct PendingRead {
    source: u64,
    alloc: usize,
    stream: StreamId,
    reader: Storage,
    seed: u64,
}

/// A graph captured into a private pool: it copies `input` (eager memory) to `output` (the
/// graph's memory). Each replay refills the input first.
struct GraphCase {
    graph: cudalloc::graph::Graph,
    alloc: usize,
    /// The stream that captured it; the input is written there.
    stream: StreamId,
    input: Storage,
    output: Storage,
}

struct World {
    rng: Rng,
    /// Pending reads on other streams (at most 8).
    reads: Vec<PendingRead>,
    /// Live graphs (at most 2).
    graphs: Vec<GraphCase>,
    /// One memory pool per allocator.
    pools: Vec<cudalloc::pool::MemPool>,
    allocators: [Arc<Runtime>; 2],
    streams: Vec<(usize, StreamId)>,
    live: BTreeMap<u64, Live>,
    /// Storages the producer dropped while consumers held them: (seed, holders). They sit in the
    /// producer's limbo; each holder's receipts must stay intact until it lets go.
    detached: BTreeMap<u64, (u64, Vec<usize>)>,
    /// How many storages may still be reclaimed "from dead consumers": one per storage that had a
    /// holder killed. A reclaim beyond it took memory from a live consumer.
    dead_reclaim_budget: u64,
    consumers: Vec<Consumer>,
    /// Which consumer index runs in its own pid namespace (its replacements too).
    namespaced_consumer: Option<usize>,
    next_id: u64,
    log: Vec<String>,
    ops: u64,
}

impl World {
    fn fresh_seed(&mut self) -> u64 {
        self.rng.next() | 1
    }

    fn pick_live(&mut self) -> Option<u64> {
        if self.live.is_empty() {
            return None;
        }
        let k = self.rng.below(self.live.len() as u64) as usize;
        self.live.keys().nth(k).copied()
    }

    /// Runs `f` with a random stream of the storage's allocator current, then synchronizes that
    /// stream (what a user does after a write before other streams read).
    fn on_random_stream<R>(&mut self, alloc: usize, f: impl FnOnce(StreamId) -> R) -> R {
        self.on_random_stream_then(alloc, true, f)
    }

    /// [`Self::on_random_stream`], synchronizing only if `sync` (sharing and lazy clones are not
    /// writes: a user does not synchronize after them).
    fn on_random_stream_then<R>(
        &mut self,
        alloc: usize,
        sync: bool,
        f: impl FnOnce(StreamId) -> R,
    ) -> R {
        let stream = self.random_stream(alloc);
        let a = &self.allocators[alloc];
        let _on = a.set_current_stream(stream).unwrap();
        let out = f(stream);
        if sync {
            a.driver().stream_synchronize(stream).unwrap();
        }
        out
    }

    /// A late copy of a live storage (a lazy clone too) on another stream of its allocator, with
    /// `record_stream`: checked later, whatever happens to the source meanwhile.
    fn read_on_another_stream(&mut self) -> Result<(), String> {
        if self.reads.len() >= 8 {
            self.finish_read(0)?;
        }
        let Some(id) = self.pick_live() else {
            return Ok(());
        };
        let alloc = self.allocator_index(&self.live[&id].storage);
        let stream = self.random_stream(alloc);
        // A third of the time the meeting point itself: a lazy clone of the storage is read
        // (late) on the other stream and dropped, then the storage is written at once — its
        // memory changes owner (the clone's last reference was the storage's own) while the
        // read is still queued. A lazy clone behaves as a copy: the writer does not wait.
        let via_clone = self.rng.below(3) == 0;
        let s = self.live[&id].storage.clone();
        let seed = self.live[&id].seed;
        let a = Arc::clone(&self.allocators[alloc]);
        let late = if via_clone { 20_000 } else { 300 };
        let enqueue = |read: &Storage| -> cudalloc::Result<Storage> {
            let reader = Storage::new_on(&a, stream, read.nbytes())?;
            let dst = reader.mutable_data_ptr_on(stream)?;
            // Late: the source's owner may drop, write or steal it back before the copy runs.
            a.driver().kernels().sleep(stream, late)?;
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe {
                a.driver().copy_device_to_device(
                    stream,
                    dst,
                    read.unordered_data_ptr(),
                    read.nbytes(),
                )
            }?;
            read.record_stream(stream)?;
            Ok(reader)
        };
        let reader = if via_clone {
            let clone = s
                .lazy_clone()
                .map_err(|e| format!("lazy_clone {id} to read: {e}"))?;
            let reader = enqueue(&clone).map_err(|e| format!("read of a clone of {id}: {e}"))?;
            drop(clone);
            let fresh = self.fresh_seed();
            let reads: Vec<StreamId> = self
                .reads
                .iter()
                .filter(|r| r.source == id)
                .map(|r| r.stream)
                .collect();
            self.on_random_stream(alloc, |on| {
                for &rs in &reads {
                    s.runtime().driver().stream_wait_stream(on, rs)?;
                }
                s.fill_pattern(fresh)
            })
            .map_err(|e| format!("write {id} after its clone's read: {e}"))?;
            self.live.get_mut(&id).unwrap().seed = fresh;
            self.log.push(format!(
                "read(lazy_clone({id})) on another stream, drop the clone, write({id}) seed {fresh}"
            ));
            // Consumers holding it see the write.
            let holders = self.live[&id].holders.clone();
            for c in holders {
                let r = self.consumers[c].ask(&format!("VERIFY {id} {fresh}"))?;
                if r != "ok 0" {
                    return Err(format!("consumer {c} sees {r} after write({id})"));
                }
            }
            reader
        } else {
            let reader = enqueue(&s).map_err(|e| format!("read of {id} on another stream: {e}"))?;
            self.log.push(format!("read({id}) on another stream"));
            reader
        };
        self.reads.push(PendingRead {
            source: if via_clone { u64::MAX } else { id },
            alloc,
            stream,
            reader,
            seed,
        });
        Ok(())
    }

    /// Captures a graph (up to two live), or replays one on a random stream of its allocator
    /// with a fresh input and checks its output.
    fn graph_step(&mut self) -> Result<(), String> {
        if self.graphs.len() < 2 && (self.graphs.is_empty() || self.rng.below(2) == 0) {
            let alloc = self.rng.below(2) as usize;
            let size = 1 + self.rng.below(1 << 20);
            let a = Arc::clone(&self.allocators[alloc]);
            let capture = || -> cudalloc::Result<GraphCase> {
                let stream = a.create_stream(0)?;
                let input = Storage::new_on(&a, stream, size)?;
                let from = input.mutable_data_ptr_on(stream)?;
                // Thread-local: the churn thread's allocations go on meanwhile.
                let capture =
                    a.begin_capture(stream, None, cudalloc::graph::CaptureMode::ThreadLocal)?;
                let output = Storage::new_on(&a, stream, size)?;
                let to = output.mutable_data_ptr_on(stream)?;
                // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                unsafe { a.driver().copy_device_to_device(stream, to, from, size) }?;
                let graph = capture.end()?;
                Ok(GraphCase {
                    graph,
                    alloc,
                    stream,
                    input,
                    output,
                })
            };
            let case = capture().map_err(|e| format!("capture a graph: {e}"))?;
            self.log
                .push(format!("capture a graph on a{alloc} ({size} bytes)"));
            self.graphs.push(case);
            return Ok(());
        }
        let k = self.rng.below(self.graphs.len() as u64) as usize;
        let alloc = self.graphs[k].alloc;
        let on = if self.rng.below(2) == 0 {
            self.graphs[k].stream
        } else {
            self.random_stream(alloc)
        };
        let seed = self.fresh_seed();
        let case = &self.graphs[k];
        let a = &self.allocators[alloc];
        let replay = || -> cudalloc::Result<u64> {
            let input = case.input.mutable_data_ptr_on(case.stream)?;
            // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
            unsafe {
                a.driver()
                    .kernels()
                    .fill_pattern(case.stream, input, case.input.nbytes(), seed)
            }?;
            // The replay reads the input: its stream waits for the fill.
            a.driver().stream_wait_stream(on, case.stream)?;
            case.graph.replay(on)?;
            a.driver().stream_synchronize(on)?;
            case.output.count_pattern_mismatches(seed)
        };
        let bad = replay().map_err(|e| format!("replay graph {k}: {e}"))?;
        self.log.push(format!("replay graph {k} seed {seed}"));
        if bad != 0 {
            return Err(format!(
                "graph {k}'s output has {bad} bytes that are not seed {seed}"
            ));
        }
        if self.rng.below(8) == 0 {
            self.log.push(format!("drop graph {k}"));
            self.graphs.remove(k);
        }
        Ok(())
    }

    /// One of the streams of allocator `alloc`.
    fn random_stream(&mut self, alloc: usize) -> StreamId {
        let choices: Vec<StreamId> = self
            .streams
            .iter()
            .filter(|(a, _)| *a == alloc)
            .map(|(_, s)| *s)
            .collect();
        choices[self.rng.below(choices.len() as u64) as usize]
    }

    /// Checks pending read `k` (its stream waited for on the host) and forgets it.
    fn finish_read(&mut self, k: usize) -> Result<(), String> {
        let r = self.reads.remove(k);
        let a = &self.allocators[r.alloc];
        a.driver()
            .stream_synchronize(r.stream)
            .map_err(|e| format!("read of {}: {e}", r.source))?;
        let bad = r
            .reader
            .count_pattern_mismatches(r.seed)
            .map_err(|e| e.to_string())?;
        if bad != 0 {
            let what = if r.source == u64::MAX {
                "a dropped lazy clone".to_owned()
            } else {
                format!("storage {}", r.source)
            };
            return Err(format!(
                "the read of {what} on another stream saw {bad} bytes that were not seed {} (the \
                 bytes it had when the read was enqueued)",
                r.seed
            ));
        }
        Ok(())
    }

    /// `ipc_collect` on both runtimes; fails if memory was reclaimed from a live consumer.
    fn collect(&mut self) -> Result<(), String> {
        for a in &self.allocators {
            let freed = a.ipc_collect().from_dead_consumers;
            if freed > self.dead_reclaim_budget {
                return Err(format!(
                    "ipc_collect reclaimed {freed} storage(s) from dead consumers, but only {} \
                     had a holder killed: memory of a live consumer was reclaimed",
                    self.dead_reclaim_budget
                ));
            }
            self.dead_reclaim_budget -= freed;
        }
        Ok(())
    }

    fn allocator_index(&self, s: &Storage) -> usize {
        usize::from(!Arc::ptr_eq(s.runtime(), &self.allocators[0]))
    }

    fn check(&self, id: u64) -> Result<(), String> {
        let l = &self.live[&id];
        let bad = l
            .storage
            .count_pattern_mismatches(l.seed)
            .map_err(|e| e.to_string())?;
        if bad != 0 {
            return Err(format!(
                "storage {id}: {bad} bytes differ from seed {}",
                l.seed
            ));
        }
        Ok(())
    }

    /// Every storage consumer `c` holds still has its bytes.
    fn verify_consumer(&mut self, c: usize) -> Result<(), String> {
        let held: Vec<(u64, u64)> = self
            .live
            .iter()
            .filter(|(_, l)| l.holders.contains(&c))
            .map(|(id, l)| (*id, l.seed))
            .chain(
                self.detached
                    .iter()
                    .filter(|(_, (_, h))| h.contains(&c))
                    .map(|(id, (seed, _))| (*id, *seed)),
            )
            .collect();
        for (id, seed) in held {
            let r = self.consumers[c].ask(&format!("VERIFY {id} {seed}"))?;
            if r != "ok 0" {
                return Err(format!(
                    "consumer {c} sees {r} for {id} after its worker ran"
                ));
            }
        }
        Ok(())
    }

    /// Forks the producer (threads running: stream workers, the churn thread, page servers) the
    /// way a data-loader pool does. The worker drops every storage it inherited, empties the
    /// caches, must be refused allocation and stream work on the inherited runtimes, and builds
    /// a runtime of its own; the parent then checks every live storage.
    fn fork_producer_worker(&mut self) -> Result<(), String> {
        self.log.push("producer forks a worker".into());
        let live: Vec<u64> = self.live.keys().copied().collect();
        let status = common::forked::in_forked_child(|| {
            for (_, l) in std::mem::take(&mut self.live) {
                drop(l.storage);
            }
            for a in &self.allocators {
                a.empty_cache();
                match Storage::new(a, 0, 4096) {
                    Err(e) if e.kind() == cudalloc::ErrorKind::ForkedChild => {}
                    Err(e) => return Err(format!("allocating in the worker: {e}")),
                    Ok(_) => return Err("the worker allocated from its parent's runtime".into()),
                }
                a.ipc_collect();
            }
            let own = Arc::new(
                Runtime::new(
                    Arc::new(
                        cudalloc::backend::HostDriver::builder()
                            .devices(1)
                            .memory_per_device(64 << 20)
                            .build()
                            .map_err(|e| e.to_string())?,
                    ),
                    Default::default(),
                )
                .map_err(|e| e.to_string())?,
            );
            let s = Storage::new(&own, 0, 1 << 20).map_err(|e| e.to_string())?;
            s.fill_pattern(11).map_err(|e| e.to_string())?;
            match s.count_pattern_mismatches(11) {
                Ok(0) => Ok(()),
                Ok(n) => Err(format!("the worker's own storage: {n} mismatches")),
                Err(e) => Err(e.to_string()),
            }
        });
        status.map_err(|e| format!("forked producer worker: {e}"))?;
        for id in live {
            self.check(id)?;
        }
        self.collect()
    }

    fn step(&mut self) -> Result<(), String> {
        self.ops += 1;
        let op = self.rng.below(112);
        match op {
            0..=19 if self.live.len() < 48 => {
                let alloc = self.rng.below(2) as usize;
                let class = match self.rng.below(4) {
                    0 => 512,
                    1 => 64 << 10,
                    2 => 1 << 20,
                    _ => 6 << 20,
                };
                let size = 1 + self.rng.below(class);
                let seed = self.fresh_seed();
                let a = Arc::clone(&self.allocators[alloc]);
                // A third of them in a memory pool or in a tag (pools of their own; a tag's on
                // expandable segments of its own).
                let place = self.rng.below(6);
                let pool = self.pools[alloc].clone();
                let storage = self.on_random_stream(alloc, |_| {
                    let _scope = match place {
                        0 => Some(a.use_mem_pool(&pool, 0)?),
                        1 => Some(a.use_tag("interplay", 0)?),
                        _ => None,
                    };
                    let s = Storage::new(&a, 0, size)?;
                    s.fill_pattern(seed)?;
                    Ok::<_, cudalloc::Error>(s)
                });
                let storage = storage.map_err(|e| format!("allocate {size}: {e}"))?;
                let id = self.next_id;
                self.next_id += 1;
                self.log.push(format!(
                    "{id} = alloc(a{alloc}, {size}, place {place}) seed {seed}"
                ));
                self.live.insert(
                    id,
                    Live {
                        storage,
                        seed,
                        holders: Vec::new(),
                    },
                );
            }
            20..=31 => {
                let Some(src) = self.pick_live() else {
                    return Ok(());
                };
                let alloc = self.allocator_index(&self.live[&src].storage);
                let s = self.live[&src].storage.clone();
                let clone = self
                    .on_random_stream_then(alloc, false, |_| s.lazy_clone())
                    .map_err(|e| format!("lazy_clone {src}: {e}"))?;
                let id = self.next_id;
                self.next_id += 1;
                let seed = self.live[&src].seed;
                self.log.push(format!("{id} = lazy_clone({src})"));
                self.live.insert(
                    id,
                    Live {
                        storage: clone,
                        seed,
                        holders: Vec::new(),
                    },
                );
            }
            32..=43 => {
                let Some(id) = self.pick_live() else {
                    return Ok(());
                };
                let seed = self.fresh_seed();
                let alloc = self.allocator_index(&self.live[&id].storage);
                let s = self.live[&id].storage.clone();
                // The writer waits for the reads of this storage still under way (not for reads
                // of its lazy clones: a lazy clone behaves as a copy).
                let reads: Vec<(usize, StreamId)> = self
                    .reads
                    .iter()
                    .filter(|r| r.source == id)
                    .map(|r| (r.alloc, r.stream))
                    .collect();
                self.on_random_stream(alloc, |stream| {
                    for &(ra, rs) in &reads {
                        if ra == alloc {
                            s.runtime().driver().stream_wait_stream(stream, rs)?;
                        }
                    }
                    s.fill_pattern(seed)
                })
                .map_err(|e| format!("write {id}: {e}"))?;
                self.log.push(format!("write({id}) seed {seed}"));
                self.live.get_mut(&id).unwrap().seed = seed;
                // Consumers holding it see the write (the memory is shared).
                let holders = self.live[&id].holders.clone();
                for c in holders {
                    let r = self.consumers[c].ask(&format!("VERIFY {id} {seed}"))?;
                    if r != "ok 0" {
                        return Err(format!("consumer {c} sees {r} after write({id})"));
                    }
                }
            }
            44..=59 => {
                let Some(id) = self.pick_live() else {
                    return Ok(());
                };
                // A consumer may already hold it: it opens it again, maybe through its other
                // runtime (two receipts, two leases, one process). Half the time the handle goes
                // to a consumer that already holds the storage, if there is one.
                let holders = self.live[&id].holders.clone();
                let c = if !holders.is_empty() && self.rng.below(2) == 0 {
                    holders[self.rng.below(holders.len() as u64) as usize]
                } else {
                    self.rng.below(self.consumers.len() as u64) as usize
                };
                let via = self.rng.below(2);
                let alloc = self.allocator_index(&self.live[&id].storage);
                let s = self.live[&id].storage.clone();
                let handle = self
                    .on_random_stream_then(alloc, false, |_| s.share_ipc())
                    .map_err(|e| format!("share {id}: {e}"))?;
                let seed = self.live[&id].seed;
                if self.rng.below(8) == 0 {
                    // Same-process receipt, through either allocator: the storage itself.
                    let into = Arc::clone(&self.allocators[self.rng.below(2) as usize]);
                    self.log.push(format!("share({id}) -> this process"));
                    let back = Storage::from_ipc(&into, handle)
                        .map_err(|e| format!("same-process receipt of {id}: {e}"))?;
                    if !back.is_alias_of(&self.live[&id].storage) {
                        return Err(format!("same-process receipt of {id} is another storage"));
                    }
                    return Ok(());
                }
                self.log
                    .push(format!("share({id}) -> consumer {c} via a{via}"));
                let line = format!("OPEN {id} {seed} {} {via}", hex(&handle.into_bytes()));
                let r = self.consumers[c].ask(&line)?;
                if r != "ok 0" {
                    return Err(format!("consumer {c} opened {id}: {r}"));
                }
                self.live.get_mut(&id).unwrap().holders.push(c);
            }
            60..=65 => {
                // A consumer writes back; the producer (and every other holder) sees it.
                let Some(id) = self.pick_live() else {
                    return Ok(());
                };
                let Some(&c) = self.live[&id].holders.first() else {
                    return Ok(());
                };
                let seed = self.fresh_seed();
                // Another process writes: the reads of this storage under way finish first.
                while let Some(k) = self.reads.iter().position(|r| r.source == id) {
                    self.finish_read(k)?;
                }
                let r = self.consumers[c].ask(&format!("WRITE {id} {seed}"))?;
                if r != "ok" {
                    return Err(format!("consumer {c} write {id}: {r}"));
                }
                self.log
                    .push(format!("consumer {c} writes {id} seed {seed}"));
                self.live.get_mut(&id).unwrap().seed = seed;
                self.check(id)?;
            }
            66..=70 => {
                // Forward from one consumer to another.
                let Some(id) = self.pick_live() else {
                    return Ok(());
                };
                let Some(&from) = self.live[&id].holders.first() else {
                    return Ok(());
                };
                let to = self.rng.below(self.consumers.len() as u64) as usize;
                if to == from {
                    return Ok(());
                }
                let via = self.rng.below(2);
                let h = self.consumers[from].ask(&format!("FORWARD {id}"))?;
                let seed = self.live[&id].seed;
                self.log
                    .push(format!("forward({id}) consumer {from} -> {to} via a{via}"));
                let r = self.consumers[to].ask(&format!("OPEN {id} {seed} {h} {via}"))?;
                if r != "ok 0" {
                    return Err(format!("consumer {to} opened forwarded {id}: {r}"));
                }
                self.live.get_mut(&id).unwrap().holders.push(to);
            }
            71..=78 => {
                let Some(id) = self.pick_live() else {
                    return Ok(());
                };
                let Some(&c) = self.live[&id].holders.last() else {
                    return Ok(());
                };
                let r = self.consumers[c].ask(&format!("DROP {id}"))?;
                if r != "ok" {
                    return Err(format!("consumer {c} drop {id}: {r}"));
                }
                self.log.push(format!("consumer {c} drops {id}"));
                self.live.get_mut(&id).unwrap().holders.pop();
            }
            0..=19 | 79..=85 => {
                let Some(id) = self.pick_live() else {
                    return Ok(());
                };
                self.log.push(format!("drop({id})"));
                let l = self.live.remove(&id).unwrap();
                if !l.holders.is_empty() {
                    // Consumers keep it (in the producer's limbo) until they let go, one receipt
                    // at a time (op 86..=90 below, or a kill).
                    self.detached.insert(id, (l.seed, l.holders));
                }
            }
            86..=90 => {
                // A consumer lets go of one receipt of a storage the producer already dropped;
                // every receipt still held (the same process's other one included) stays intact.
                if self.detached.is_empty() {
                    return Ok(());
                }
                let k = self.rng.below(self.detached.len() as u64) as usize;
                let id = *self.detached.keys().nth(k).unwrap();
                let (seed, holders) = self.detached.get_mut(&id).unwrap();
                let (seed, c) = (*seed, holders.pop().unwrap());
                let left = holders.clone();
                if left.is_empty() {
                    self.detached.remove(&id);
                }
                let r = self.consumers[c].ask(&format!("DROP {id}"))?;
                if r != "ok" {
                    return Err(format!("consumer {c} drop detached {id}: {r}"));
                }
                self.log.push(format!("consumer {c} drops detached {id}"));
                // The producer collects (this is when a wrongly unlocked slot gets reclaimed).
                self.collect()?;
                for h in left {
                    let r = self.consumers[h].ask(&format!("VERIFY {id} {seed}"))?;
                    if r != "ok 0" {
                        return Err(format!(
                            "consumer {h} holds detached {id} but sees {r} after another receipt was dropped and the producer collected"
                        ));
                    }
                }
            }
            91..=93 if self.rng.below(2) == 0 => {
                // Settings changed under the run (issue 38): allocator 0's cross-stream policy
                // and rounding, while its storages, pools, graphs and shares live on.
                let policy = ["off", "segments", "blocks"][self.rng.below(3) as usize];
                let divisions = [1, 4][self.rng.below(2) as usize];
                let changes =
                    format!("cross_stream_reuse:{policy},roundup_power2_divisions:{divisions}");
                self.log.push(format!("reconfigure allocator 0: {changes}"));
                self.allocators[0]
                    .reconfigure(&changes)
                    .map_err(|e| format!("reconfigure {changes}: {e}"))?;
            }
            91..=93 => {
                self.log.push("empty_cache".into());
                for a in &self.allocators {
                    a.empty_cache();
                }
            }
            94..=96 => {
                self.log.push("ipc_collect".into());
                self.collect()?;
            }
            97 => self.fork_producer_worker()?,
            100..=104 => self.read_on_another_stream()?,
            105..=107 => self.graph_step()?,
            108..=110 if !self.reads.is_empty() => {
                let k = self.rng.below(self.reads.len() as u64) as usize;
                self.finish_read(k)?;
            }
            98 => {
                // A consumer forks a worker that drops every storage it inherited.
                let c = self.rng.below(self.consumers.len() as u64) as usize;
                self.log.push(format!("consumer {c} forks a worker"));
                let r = self.consumers[c].ask("FORK")?;
                if r != "ok" {
                    return Err(format!("consumer {c}'s forked worker: {r}"));
                }
                self.collect()?;
                self.verify_consumer(c)?;
            }
            99 | 111 => {
                // SIGKILL a consumer while it holds storages; replace it.
                let c = self.rng.below(self.consumers.len() as u64) as usize;
                self.log.push(format!("kill consumer {c}"));
                let namespaced = self.namespaced_consumer == Some(c);
                let old = std::mem::replace(&mut self.consumers[c], Consumer::spawn(namespaced));
                old.kill();
                let lost = self
                    .live
                    .values()
                    .filter(|l| l.holders.contains(&c))
                    .count()
                    + self
                        .detached
                        .values()
                        .filter(|(_, h)| h.contains(&c))
                        .count();
                self.dead_reclaim_budget += lost as u64;
                for l in self.live.values_mut() {
                    l.holders.retain(|&h| h != c);
                }
                for (_, holders) in self.detached.values_mut() {
                    holders.retain(|&h| h != c);
                }
                self.detached.retain(|_, (_, holders)| !holders.is_empty());
                self.collect()?;
            }
            _ => {}
        }
        // Every live producer storage still holds its bytes (checked every few operations: the
        // verify kernel reads every byte).
        if self.ops.is_multiple_of(4) {
            let ids: Vec<u64> = self.live.keys().copied().collect();
            for id in ids {
                self.check(id)?;
            }
            let detached: Vec<(u64, u64, Vec<usize>)> = self
                .detached
                .iter()
                .map(|(id, (seed, holders))| (*id, *seed, holders.clone()))
                .collect();
            for (id, seed, holders) in detached {
                for c in holders {
                    let r = self.consumers[c].ask(&format!("VERIFY {id} {seed}"))?;
                    if r != "ok 0" {
                        return Err(format!("consumer {c} holds detached {id} but sees {r}"));
                    }
                }
            }
        }
        Ok(())
    }
}

fn consumer_main() {
    // Two allocators (each over its own driver) in one consumer process.
    let allocators =
        [0, 1].map(|_| Arc::new(Runtime::new(test_driver(), Default::default()).unwrap()));
    // Receipts by id (a storage opened twice, through either allocator, has two).
    let mut held: BTreeMap<u64, Vec<Storage>> = BTreeMap::new();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    for line in stdin.lock().lines() {
        let line = line.unwrap();
        let parts: Vec<&str> = line.split(' ').collect();
        let id: u64 = parts.get(1).and_then(|p| p.parse().ok()).unwrap_or(0);
        let verify = |storages: &[Storage], seed: u64| -> String {
            let mut bad = 0;
            for s in storages {
                match s.count_pattern_mismatches(seed) {
                    Ok(n) => bad += n,
                    Err(e) => return format!("error {e}"),
                }
            }
            format!("ok {bad}")
        };
        let reply = match parts[0] {
            "OPEN" => {
                let seed: u64 = parts[2].parse().unwrap();
                let a = &allocators[parts[4].parse::<usize>().unwrap()];
                match IpcHandle::from_bytes(&unhex(parts[3])).and_then(|h| Storage::from_ipc(a, h))
                {
                    Ok(s) => {
                        let receipts = held.entry(id).or_default();
                        receipts.push(s);
                        verify(receipts, seed)
                    }
                    Err(e) => format!("error {e}"),
                }
            }
            "VERIFY" => {
                let seed: u64 = parts[2].parse().unwrap();
                match held.get(&id) {
                    Some(receipts) => verify(receipts, seed),
                    None => "error not held".into(),
                }
            }
            "WRITE" => {
                let seed: u64 = parts[2].parse().unwrap();
                match held.get(&id).and_then(|r| r.first()) {
                    Some(s) => match s.fill_pattern(seed).and_then(|()| {
                        let a = s.runtime();
                        a.driver().stream_synchronize(a.current_stream(0)?)
                    }) {
                        Ok(()) => "ok".into(),
                        Err(e) => format!("error {e}"),
                    },
                    None => "error not held".into(),
                }
            }
            "FORWARD" => match held.get(&id).and_then(|r| r.first()).map(|s| s.share_ipc()) {
                Some(Ok(h)) => hex(&h.into_bytes()),
                Some(Err(e)) => format!("error {e}"),
                None => "error not held".into(),
            },
            "PID" => std::fs::read_link("/proc/self")
                .map(|p| p.display().to_string())
                .unwrap_or_else(|e| format!("error {e}")),
            "NSPID" => std::process::id().to_string(),
            "FORK" => fork_consumer_worker(&mut held),
            "DROP" => {
                // One receipt goes; the others must stay intact.
                if let Some(receipts) = held.get_mut(&id) {
                    receipts.pop();
                    if receipts.is_empty() {
                        held.remove(&id);
                    }
                }
                "ok".into()
            }
            other => format!("error unknown command {other}"),
        };
        writeln!(out, "{reply}").unwrap();
        out.flush().unwrap();
    }
}

/// A consumer's data-loader worker: drops every storage it inherited (which must release
/// nothing of its parent's) and exits.
fn fork_consumer_worker(held: &mut BTreeMap<u64, Vec<Storage>>) -> String {
    match common::forked::in_forked_child(|| {
        drop(std::mem::take(held));
        Ok(())
    }) {
        Ok(()) => "ok".into(),
        Err(e) => format!("error {e}"),
    }
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    if std::env::args().any(|a| a == "--consumer") {
        consumer_main();
        return;
    }
    let seed = arg("--seed")
        .or_else(|| std::env::var("INTERPLAY_SEED").ok())
        .map(|s| s.parse::<u64>().expect("--seed takes a number"))
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                ^ u64::from(std::process::id())
        });
    let seconds: f64 = arg("--seconds")
        .or_else(|| std::env::var("INTERPLAY_SECONDS").ok())
        .map(|s| s.parse().expect("--seconds takes a number"))
        .unwrap_or(10.0);
    println!("interplay: seed {seed}, budget {seconds} s (replay: cargo test --test interplay -- --seed {seed})");
    // The second allocator keeps thread front caches (`thread_cache_mb`, issue 14): its freed
    // blocks may be reused by this thread without its shards' locks, and must still never be
    // handed out twice, shared after reuse or lost.
    // The first starts under a cross-stream policy chosen by the seed (issue 38: another stream's
    // idle memory taken over or lent, ordered after its work) and changes it during the run.
    let first = [
        "",
        "cross_stream_reuse:segments",
        "cross_stream_reuse:blocks",
    ][(seed % 3) as usize];
    println!("interplay: allocator 0 starts with {first:?}");
    let allocators = [0, 1].map(|i| {
        Arc::new(
            Runtime::builder()
                .config(test_config(if i == 1 {
                    "thread_cache_mb:16"
                } else {
                    first
                }))
                .ipc_slots_per_file(32)
                .check_invariants(true)
                .build(if cuda_suite() {
                    test_driver()
                } else {
                    Arc::new(
                        cudalloc::backend::HostDriver::builder()
                            .devices(1)
                            .memory_per_device(256 << 20)
                            .build()
                            .unwrap(),
                    )
                })
                .unwrap(),
        )
    });
    let mut streams = Vec::new();
    for (i, a) in allocators.iter().enumerate() {
        streams.push((i, a.default_stream(0).unwrap()));
        streams.push((i, a.create_stream(0).unwrap()));
        streams.push((i, a.create_stream(0).unwrap()));
    }
    // Churn: another thread allocating, writing and freeing on its own stream of allocator 0, so
    // freed memory is reused (and its segments freed and poisoned) while the run goes on.
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let (a, stop) = (Arc::clone(&allocators[0]), Arc::clone(&stop));
        std::thread::spawn(move || {
            let stream = a.create_stream(0).unwrap();
            let _on = a.set_current_stream(stream).unwrap();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let size = 512 + pattern::word(seed, i) % (3 << 20);
                if let Ok(s) = Storage::new(&a, 0, size) {
                    s.fill_pattern(i).unwrap();
                    assert_eq!(s.count_pattern_mismatches(i).unwrap(), 0, "churn storage");
                }
                if i.is_multiple_of(64) {
                    a.empty_cache();
                }
            }
            i
        })
    };
    let namespaced_consumer = match pid_namespace_available() {
        Ok(()) => {
            println!("interplay: consumer 2 runs in a pid namespace of its own");
            Some(2)
        }
        Err(why) => {
            println!("interplay: the pid-namespace consumer is skipped: {why}");
            None
        }
    };
    let pools = allocators
        .iter()
        .map(|a| a.mem_pool(Default::default()).unwrap())
        .collect();
    let mut world = World {
        rng: Rng(seed, 0),
        reads: Vec::new(),
        graphs: Vec::new(),
        pools,
        allocators,
        streams,
        live: BTreeMap::new(),
        detached: BTreeMap::new(),
        dead_reclaim_budget: 0,
        consumers: (0..3)
            .map(|i| Consumer::spawn(namespaced_consumer == Some(i)))
            .collect(),
        namespaced_consumer,
        next_id: 0,
        log: Vec::new(),
        ops: 0,
    };
    let start = Instant::now();
    let mut failure = None;
    while start.elapsed() < Duration::from_secs_f64(seconds) {
        if let Err(e) = world.step() {
            failure = Some(e);
            break;
        }
    }
    // The reads still pending are checked too.
    while failure.is_none() && !world.reads.is_empty() {
        if let Err(e) = world.finish_read(0) {
            failure = Some(e);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let churned = churn.join();
    if failure.is_none() {
        if let Err(panic) = &churned {
            failure = Some(format!("churn thread panicked: {panic:?}"));
        }
    }
    if let Some(e) = failure {
        let tail = world.log.len().saturating_sub(60);
        eprintln!(
            "interplay FAILED (seed {seed}) after {} operations: {e}",
            world.ops
        );
        eprintln!("last operations:");
        for l in &world.log[tail..] {
            eprintln!("  {l}");
        }
        eprintln!("replay: cargo test --test interplay -- --seed {seed}");
        for c in world.consumers.drain(..) {
            c.kill();
        }
        std::process::exit(1);
    }
    // Teardown: consumers release everything, producers drop and collect; nothing may be left.
    for mut c in world.consumers.drain(..) {
        drop(c.stdin);
        let _ = c.child.wait();
    }
    world.live.clear();
    world.graphs.clear();
    world.pools.clear();
    for a in &world.allocators {
        a.ipc_collect();
        assert_eq!(
            a.ipc_limbo(),
            (0, 0),
            "limbo drained at the end (seed {seed})"
        );
    }
    let count = |what: &str| world.log.iter().filter(|l| l.contains(what)).count();
    println!(
        "interplay: seed {seed}: {} operations ({} producer forks, {} consumer forks, {} consumers \
         killed, {} reads on other streams, {} graph replays), {} churn allocations in {:.1} s",
        world.ops,
        count("producer forks"),
        count("forks a worker") - count("producer forks"),
        count("kill consumer"),
        count("on another stream"),
        count("replay graph"),
        churned.unwrap_or(0),
        start.elapsed().as_secs_f64()
    );
    println!(
        "interplay: allocator 0 reconfigured {} times, {} misses served by another stream's memory",
        count("reconfigure allocator 0"),
        world.allocators[0]
            .memory_stats(0)
            .unwrap()
            .num_cross_stream_reuses
    );
    println!("interplay: 1 passed, 0 failed");
}
