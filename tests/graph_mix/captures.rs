//! Capture steps: beginning, temporaries, outputs, forks and joins, ending and aborting.

use super::*;

impl World<'_> {
    /// Marks the real work of `s` before a capture takes it.
    pub(super) fn mark(&mut self, s: StreamId) {
        let e = self.d.event_create(0, EventFlags::default()).unwrap();
        self.d.event_record(e, s).unwrap();
        assert!(self.marks.insert(s, e).is_none());
    }

    /// `s` left its capture: it runs work again.
    pub(super) fn unmark(&mut self, s: StreamId) {
        let e = self.marks.remove(&s).unwrap();
        self.d.event_destroy(e).unwrap();
    }

    pub(super) fn begin(&mut self) {
        if self.open.len() >= MAX_OPEN || self.graphs.len() + self.open.len() >= MAX_GRAPHS {
            return;
        }
        let Some(s) = self.idle_stream(None) else {
            return;
        };
        let mode = match self.rng.below(10) {
            0..=3 => CaptureMode::Global,
            4..=5 => CaptureMode::ThreadLocal,
            _ => CaptureMode::Relaxed,
        };
        // A pool to share: a live graph's or a held handle's, that no open capture uses.
        let mut shareable: Vec<MemPool> =
            self.graphs.iter().map(|g| g.graph.pool().clone()).collect();
        shareable.extend(self.handles.iter().cloned());
        shareable.retain(|p| !self.pool_busy(p.id()));
        let pool = if !shareable.is_empty() && self.rng.chance(50) {
            Some(shareable.swap_remove(self.rng.index(shareable.len())))
        } else {
            None
        };
        drop(shareable);
        if let Some(p) = &pool {
            // A later capture may take what the pool's graphs freed: after their replays.
            for &u in self.pool_users.get(&p.id()).into_iter().flatten() {
                order(&self.d, &self.marks, s, u);
            }
        }
        let input = if self.rng.chance(40) {
            self.random_eager()
        } else {
            None
        };
        if let Some(k) = input {
            let e = self.eager.get_mut(&k).unwrap();
            // The capture reads the input on `s` (at every replay, on the replay stream).
            e.pins += 1;
        }
        self.mark(s);
        let capture = self.a.begin_capture(s, pool.as_ref(), mode).unwrap();
        if let Some(k) = input {
            let e = &self.eager[&k];
            if e.home != s {
                // Used on the capturing stream (and at replays on theirs, recorded then).
                self.a.record_stream(&e.ptr, s).unwrap();
            }
        }
        let id = capture.pool().id();
        match &pool {
            Some(p) => assert_eq!(id, p.id(), "the capture allocates from the shared pool"),
            None => assert!(
                !id.is_default() && !id.is_user_created(),
                "a capture's own pool: {id}"
            ),
        }
        let name = self.next_name;
        self.next_name += 1;
        self.counts.captures += 1;
        self.counts.shared += u64::from(pool.is_some());
        self.note(format!(
            "begin g{name} on s{} {mode:?} pool {id}{}{}",
            self.sid(s),
            if pool.is_some() { " (shared)" } else { "" },
            input.map(|k| format!(" input e{k}")).unwrap_or_default()
        ));
        self.open.push(Open {
            capture,
            name,
            stream: s,
            mode,
            pool: id,
            input,
            temps: Vec::new(),
            output: None,
            side: None,
            ranges: Vec::new(),
            events: Vec::new(),
        });
    }

    /// One step of a random open capture.
    pub(super) fn capture_op(&mut self) {
        if self.open.is_empty() {
            return;
        }
        let c = self.rng.index(self.open.len());
        match self.rng.below(100) {
            0..=29 => self.capture_temp(c),
            30..=44 => self.capture_free_temp(c),
            45..=59 => self.capture_output(c),
            60..=74 => self.capture_fork_or_join(c),
            75..=95 => self.end(c, false),
            _ => self.end(c, true),
        }
    }

    /// The stream a capture's next work goes to: its origin, or its forked stream.
    pub(super) fn capture_stream(&mut self, c: usize) -> StreamId {
        match self.open[c].side {
            Some((t, _)) if self.rng.chance(50) => {
                self.open[c].side = Some((t, false));
                t
            }
            _ => self.open[c].stream,
        }
    }

    /// Allocates `n` bytes inside capture `c` on `on`; `None` (the capture aborted) when out of
    /// memory.
    pub(super) fn capture_alloc(&mut self, c: usize, on: StreamId, n: u64) -> Option<DataPtr> {
        match self.alloc(on, n) {
            Ok(p) => {
                let pool = self.open[c].pool;
                assert!(
                    in_pool(&self.a, pool, p.ptr().0, n),
                    "a {n}-byte allocation of capture g{} at {:#x} is not in its pool {pool}",
                    self.open[c].name,
                    p.ptr().0
                );
                self.open[c].ranges.push((p.ptr().0, n));
                Some(p)
            }
            Err(err) if is_oom(&err) => {
                self.counts.ooms += 1;
                self.note(format!(
                    "g{}: {n} bytes on s{}: out of memory inside the capture",
                    self.open[c].name,
                    self.sid(on)
                ));
                self.abort(c);
                None
            }
            Err(err) => panic!("allocation of {n} bytes inside a capture: {err}"),
        }
    }

    /// Writes `dst` (`n` bytes) on `on` inside capture `c`: from a temporary or the input when
    /// one is long enough, else the pattern of a fresh seed. Returns what it then holds.
    pub(super) fn capture_write(
        &mut self,
        c: usize,
        on: StreamId,
        dst: &DataPtr,
        n: u64,
    ) -> Content {
        let roll = self.rng.below(3);
        if roll == 0 {
            let sources: Vec<usize> = (0..self.open[c].temps.len())
                .filter(|&i| {
                    self.open[c].temps[i].len >= n && self.open[c].temps[i].ptr.ptr() != dst.ptr()
                })
                .collect();
            if !sources.is_empty() {
                let t = &self.open[c].temps[sources[self.rng.index(sources.len())]];
                // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                unsafe { self.d.copy_device_to_device(on, dst.ptr(), t.ptr.ptr(), n) }.unwrap();
                if on != t.home {
                    self.a.record_stream(&t.ptr, on).unwrap();
                }
                return t.content;
            }
        }
        if roll == 1 {
            if let Some(k) = self.open[c].input.filter(|k| self.eager[k].len >= n) {
                let e = &self.eager[&k];
                // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
                unsafe { self.d.copy_device_to_device(on, dst.ptr(), e.ptr.ptr(), n) }.unwrap();
                return Content::Input;
            }
        }
        let seed = self.seed();
        // SAFETY: test memory this test owns, ordered on its streams; no typed host kernel sees it.
        unsafe { self.d.kernels().fill_pattern(on, dst.ptr(), n, seed) }.unwrap();
        Content::Seed(seed)
    }

    pub(super) fn capture_temp(&mut self, c: usize) {
        if self.open[c].temps.len() >= MAX_TEMPS {
            return;
        }
        let on = self.capture_stream(c);
        let n = self.rng.size();
        let Some(ptr) = self.capture_alloc(c, on, n) else {
            return;
        };
        let content = self.capture_write(c, on, &ptr, n);
        self.note(format!(
            "g{}: temp {n} bytes at {:#x} on s{} holds {content:?}",
            self.open[c].name,
            ptr.ptr().0,
            self.sid(on)
        ));
        self.open[c].temps.push(Temp {
            ptr,
            len: n,
            content,
            home: on,
        });
    }

    pub(super) fn capture_free_temp(&mut self, c: usize) {
        if self.open[c].temps.is_empty() {
            return;
        }
        let i = self.rng.index(self.open[c].temps.len());
        let t = self.open[c].temps.swap_remove(i);
        self.note(format!(
            "g{}: free temp at {:#x}",
            self.open[c].name,
            t.ptr.ptr().0
        ));
    }

    pub(super) fn capture_output(&mut self, c: usize) {
        let on = self.capture_stream(c);
        if let Some((out, _)) = self.open[c].output.take() {
            // Rewritten later in the capture: the last write is what a replay leaves.
            let content = self.capture_write(c, on, &out.ptr, out.len);
            if on != out.home {
                self.a.record_stream(&out.ptr, on).unwrap();
            }
            self.note(format!(
                "g{}: output rewritten on s{} holds {content:?}",
                self.open[c].name,
                self.sid(on)
            ));
            self.open[c].output = Some((out, content));
            return;
        }
        let n = self.rng.size();
        let Some(ptr) = self.capture_alloc(c, on, n) else {
            return;
        };
        let content = self.capture_write(c, on, &ptr, n);
        self.note(format!(
            "g{}: output {n} bytes at {:#x} on s{} holds {content:?}",
            self.open[c].name,
            ptr.ptr().0,
            self.sid(on)
        ));
        self.open[c].output = Some((
            Temp {
                ptr,
                len: n,
                content,
                home: on,
            },
            content,
        ));
    }

    pub(super) fn capture_fork_or_join(&mut self, c: usize) {
        let s = self.open[c].stream;
        match self.open[c].side {
            None => {
                let idle = self.idle();
                if idle.is_empty() {
                    return;
                }
                let t = idle[self.rng.index(idle.len())];
                self.mark(t);
                let e = self.d.event_create(0, EventFlags::default()).unwrap();
                self.d.event_record(e, s).unwrap();
                self.d.stream_wait_event(t, e).unwrap();
                self.open[c].events.push(e);
                self.open[c].side = Some((t, false));
                self.counts.forks += 1;
                self.note(format!("g{}: fork s{}", self.open[c].name, self.sid(t)));
            }
            Some((t, _)) => {
                self.join(c);
                self.note(format!("g{}: join s{}", self.open[c].name, self.sid(t)));
            }
        }
    }

    /// Joins capture `c`'s forked stream back (its last work) into the origin.
    pub(super) fn join(&mut self, c: usize) {
        let Some((t, joined)) = self.open[c].side else {
            return;
        };
        if !joined {
            let e = self.d.event_create(0, EventFlags::default()).unwrap();
            self.d.event_record(e, t).unwrap();
            self.d.stream_wait_event(self.open[c].stream, e).unwrap();
            self.open[c].events.push(e);
            self.open[c].side = Some((t, true));
        }
    }

    /// Ends capture `c` (or aborts it).
    pub(super) fn end(&mut self, c: usize, abort: bool) {
        if abort {
            self.note(format!("g{}: abort", self.open[c].name));
            self.abort(c);
            return;
        }
        if self.open[c].output.is_none() {
            self.capture_output(c);
            if c >= self.open.len() || self.open[c].output.is_none() {
                return; // aborted: out of memory
            }
        }
        self.join(c);
        let mut o = self.open.swap_remove(c);
        // The temporaries die inside the capture; the pool keeps their memory for the replays.
        o.temps.clear();
        let graph = o.capture.end().unwrap();
        assert!(graph.node_count() > 0);
        for e in o.events.drain(..) {
            self.d.event_destroy(e).unwrap();
        }
        self.unmark(o.stream);
        if let Some((t, _)) = o.side {
            self.unmark(t);
        }
        let (out, content) = o.output.take().unwrap();
        self.note(format!(
            "end g{}: {} nodes, output {} bytes holds {content:?}",
            o.name,
            graph.node_count(),
            out.len
        ));
        self.counts.graphs += 1;
        self.pool_users.entry(o.pool).or_default().push(o.stream);
        self.graphs.push(Live {
            graph,
            name: o.name,
            pool: o.pool,
            output: Output {
                ptr: out.ptr,
                len: out.len,
                home: out.home,
                pool: o.pool,
                valid: None,
                uses: Uses::default(),
            },
            content,
            input: o.input,
            ranges: o.ranges,
        });
    }

    /// Drops capture `c` without its end (its graph discarded), with everything it allocated.
    pub(super) fn abort(&mut self, c: usize) {
        let mut o = self.open.swap_remove(c);
        // Joined, so that the forked stream leaves the capture cleanly either way.
        if let Some((t, false)) = o.side {
            let e = self.d.event_create(0, EventFlags::default()).unwrap();
            self.d.event_record(e, t).unwrap();
            self.d.stream_wait_event(o.stream, e).unwrap();
            o.events.push(e);
        }
        o.temps.clear();
        o.output = None;
        drop(o.capture);
        for e in o.events.drain(..) {
            self.d.event_destroy(e).unwrap();
        }
        self.unmark(o.stream);
        if let Some((t, _)) = o.side {
            self.unmark(t);
        }
        if let Some(k) = o.input {
            self.eager.get_mut(&k).unwrap().pins -= 1;
        }
        self.counts.aborted += 1;
    }

    // ---- graphs ----
}
