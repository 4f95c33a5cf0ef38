//! The world of the graph mix: its bounds, random source, ordering helpers and state; the
//! steps are in this folder's other files (eager work, captures, replays and drops, the checks).

use super::*;

mod captures;
mod checks;
mod eager;
mod replays;

/// xorshift64*, seeded through splitmix64.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(cudalloc::internals::pattern::word(seed, 1) | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn index(&mut self, len: usize) -> usize {
        self.below(len as u64) as usize
    }

    /// A size from 512 B to just under 8 MiB (odd sizes included): a power-of-two band, smaller
    /// ones likelier (the smaller of two uniform draws), then uniform within it.
    fn size(&mut self) -> u64 {
        let band = self.below(14).min(self.below(14));
        let low = 1u64 << (9 + band);
        low + self.below(low)
    }
}

/// The streams that touched a buffer since its last write: the writer's and the readers'.
#[derive(Debug, Default)]
struct Uses {
    writer: Option<StreamId>,
    readers: Vec<StreamId>,
}

impl Uses {
    fn written(on: StreamId) -> Self {
        Uses {
            writer: Some(on),
            readers: Vec::new(),
        }
    }

    fn read(&mut self, on: StreamId) {
        if !self.readers.contains(&on) {
            self.readers.push(on);
        }
    }

    fn wrote(&mut self, on: StreamId) {
        *self = Uses::written(on);
    }
}

/// Events recorded on streams just before a capture took them (as origin or forked stream):
/// while a stream is captured, its real work is what came before its mark.
type Marks = HashMap<StreamId, EventId>;

/// Makes `on` wait for the work of `after` (nothing when it is `on`): for a captured stream,
/// the work before its capture (waiting on the capture itself would fork `on` into it).
fn order(d: &Arc<dyn Driver>, marks: &Marks, on: StreamId, after: StreamId) {
    if on == after {
        return;
    }
    match marks.get(&after) {
        Some(&mark) => d.stream_wait_event(on, mark).unwrap(),
        None => d.stream_wait_stream(on, after).unwrap(),
    }
}

/// Orders a read on `on` after the buffer's last write.
fn before_read(d: &Arc<dyn Driver>, marks: &Marks, on: StreamId, uses: &Uses) {
    if let Some(w) = uses.writer {
        order(d, marks, on, w);
    }
}

/// Orders a write on `on` after the buffer's last write and the reads since.
fn before_write(d: &Arc<dyn Driver>, marks: &Marks, on: StreamId, uses: &Uses) {
    before_read(d, marks, on, uses);
    for &r in &uses.readers {
        order(d, marks, on, r);
    }
}

/// An eager block: allocated outside every capture, from the default pool.
struct Eager {
    ptr: DataPtr,
    len: u64,
    seed: u64,
    /// The stream it was allocated on.
    home: StreamId,
    uses: Uses,
    /// Graphs and open captures that read it (it lives while they do).
    pins: usize,
}

/// What a captured buffer holds after its part of a replay: the pattern of a seed, or the first
/// bytes of the capture's eager input (its pattern at the replay).
#[derive(Clone, Copy, Debug)]
enum Content {
    Seed(u64),
    Input,
}

/// A graph's output (also once the graph is gone: an orphan).
struct Output {
    ptr: DataPtr,
    len: u64,
    /// The stream it was allocated on (inside the capture).
    home: StreamId,
    pool: MemPoolId,
    /// The seed it holds now, when known (after a replay, until a replay of a graph sharing the
    /// pool may have reused its bytes).
    valid: Option<u64>,
    uses: Uses,
}

/// A live graph.
struct Live {
    graph: Graph,
    name: usize,
    pool: MemPoolId,
    output: Output,
    content: Content,
    input: Option<u64>,
    /// Every range its capture allocated (temporaries and output): the graph's memory.
    ranges: Vec<(u64, u64)>,
}

/// A temporary of an open capture.
struct Temp {
    ptr: DataPtr,
    len: u64,
    content: Content,
    /// The stream it was allocated on.
    home: StreamId,
}

/// A capture under way.
struct Open {
    capture: Capture,
    name: usize,
    stream: StreamId,
    mode: CaptureMode,
    pool: MemPoolId,
    input: Option<u64>,
    temps: Vec<Temp>,
    output: Option<(Temp, Content)>,
    /// A stream forked into the capture, and whether the origin joined its last work.
    side: Option<(StreamId, bool)>,
    ranges: Vec<(u64, u64)>,
    events: Vec<EventId>,
}

#[derive(Debug, Default)]
pub(crate) struct Counts {
    steps: u64,
    eager_allocs: u64,
    captures: u64,
    graphs: u64,
    aborted: u64,
    replays: u64,
    output_checks: u64,
    eager_checks: u64,
    ooms: u64,
    shared: u64,
    forks: u64,
}

pub(crate) struct World<'l> {
    d: Arc<dyn Driver>,
    a: Runtime,
    rng: Rng,
    log: &'l RefCell<Vec<String>>,
    streams: Vec<StreamId>,
    eager: BTreeMap<u64, Eager>,
    graphs: Vec<Live>,
    orphans: Vec<Output>,
    handles: Vec<MemPool>,
    open: Vec<Open>,
    /// Per pool, the streams whose work on its memory the next replay (or sharing capture) of
    /// one of its graphs must follow.
    pool_users: HashMap<MemPoolId, Vec<StreamId>>,
    marks: Marks,
    /// A large unwritten eager block, while held (`pressure`).
    pressure: Option<(DataPtr, u64)>,
    next_key: u64,
    next_seed: u64,
    next_name: usize,
    counts: Counts,
    /// Whether the device's requested bytes are exact: a block reused from a thread front cache
    /// keeps the requested size of its earlier allocation (`src/alloc/front.rs`).
    exact_requested: bool,
}

fn is_oom(err: &cudalloc::Error) -> bool {
    err.kind() == ErrorKind::OutOfMemory
}

impl<'l> World<'l> {
    /// Takes `ptr` (`n` bytes, written with `seed` on `h`) in as a new eager block, `what` it is
    /// for the log.
    fn adopt_eager(&mut self, ptr: DataPtr, n: u64, seed: u64, h: StreamId, what: String) {
        let key = self.next_key;
        self.next_key += 1;
        self.note(format!(
            "eager e{key}: {what} at {:#x} on s{}",
            ptr.ptr().0,
            self.sid(h)
        ));
        self.counts.eager_allocs += 1;
        self.eager.insert(
            key,
            Eager {
                ptr,
                len: n,
                seed,
                home: h,
                uses: Uses::written(h),
                pins: 0,
            },
        );
    }
    pub(crate) fn new(seed: u64, conf: &str, log: &'l RefCell<Vec<String>>) -> Self {
        let (driver, cap) = common::sized_driver(256 * MIB);
        let driver = common::sanitized(driver);
        // The property is sanitizer-checked: report mode when the environment asks for nothing.
        let d = if driver.sanitizer().is_some() {
            driver
        } else {
            SanitizedDriver::wrap(driver, SanitizeOptions::report())
        };
        let a = Runtime::builder()
            .config(common::test_config(&common::join_conf(conf, &cap)))
            .check_invariants(true)
            .build(Arc::clone(&d))
            .unwrap();
        let streams = (0..STREAMS).map(|_| a.create_stream(0).unwrap()).collect();
        World {
            d,
            a,
            rng: Rng::new(seed),
            log,
            streams,
            eager: BTreeMap::new(),
            graphs: Vec::new(),
            orphans: Vec::new(),
            handles: Vec::new(),
            open: Vec::new(),
            pool_users: HashMap::new(),
            marks: Marks::new(),
            pressure: None,
            next_key: 0,
            next_seed: seed.wrapping_mul(1_000_003) + 1,
            next_name: 0,
            counts: Counts::default(),
            exact_requested: !conf.contains("thread_cache_mb"),
        }
    }

    fn note(&self, line: String) {
        self.log.borrow_mut().push(line);
    }

    fn seed(&mut self) -> u64 {
        self.next_seed += 1;
        self.next_seed
    }

    fn sid(&self, s: StreamId) -> usize {
        self.streams.iter().position(|&x| x == s).unwrap()
    }

    /// Streams some open capture holds (origins and forked streams).
    fn busy(&self) -> Vec<StreamId> {
        let mut out = Vec::new();
        for o in &self.open {
            out.push(o.stream);
            if let Some((t, _)) = o.side {
                out.push(t);
            }
        }
        out
    }

    /// Streams that run eager work now.
    fn idle(&self) -> Vec<StreamId> {
        let busy = self.busy();
        self.streams
            .iter()
            .copied()
            .filter(|s| !busy.contains(s))
            .collect()
    }

    /// A random idle stream, `prefer` more often when it is idle.
    fn idle_stream(&mut self, prefer: Option<StreamId>) -> Option<StreamId> {
        let idle = self.idle();
        if let Some(p) = prefer.filter(|p| idle.contains(p)) {
            if self.rng.chance(60) {
                return Some(p);
            }
        }
        if idle.is_empty() {
            return None;
        }
        Some(idle[self.rng.index(idle.len())])
    }

    /// Whether this thread may block or get memory from the driver: no capture of it prohibits
    /// unsafe calls (only Relaxed ones are open).
    fn unprohibited(&self) -> bool {
        self.open.iter().all(|o| o.mode == CaptureMode::Relaxed)
    }

    fn pool_busy(&self, pool: MemPoolId) -> bool {
        self.open.iter().any(|o| o.pool == pool)
    }

    fn live_pools(&self) -> Vec<MemPoolId> {
        let mut out: Vec<MemPoolId> = self.graphs.iter().map(|g| g.pool).collect();
        out.extend(self.handles.iter().map(MemPool::id));
        out.extend(self.open.iter().map(|o| o.pool));
        out.sort_by_key(|p| p.as_pair());
        out.dedup();
        out
    }

    // ---- eager work ----
}

#[derive(Clone, Copy, Debug)]
enum Target {
    Graph(usize),
    Orphan(usize),
}

/// Whether `[at, at + n)` lies in blocks of pool `pool`'s segments (`blocks` by address).
fn covered(
    blocks: &BTreeMap<u64, (u64, MemPoolId, SnapshotBlockState)>,
    pool: MemPoolId,
    at: u64,
    n: u64,
) -> bool {
    let mut cur = at;
    while cur < at + n {
        match blocks.range(..=cur).next_back() {
            Some((_, &(end, p, _))) if p == pool && end > cur => cur = end,
            _ => return false,
        }
    }
    true
}

/// Whether `[at, at + n)` lies in blocks of pool `pool`.
pub(crate) fn in_pool(a: &Runtime, pool: MemPoolId, at: u64, n: u64) -> bool {
    let blocks: BTreeMap<u64, (u64, MemPoolId, SnapshotBlockState)> = a
        .snapshot()
        .segments
        .iter()
        .flat_map(|s| {
            s.blocks
                .iter()
                .map(move |b| (b.addr, (b.addr + b.size, s.segment_pool_id, b.state)))
        })
        .collect();
    covered(&blocks, pool, at, n)
}
