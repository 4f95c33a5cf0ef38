//! Graph replays under the sanitizer: what a capture touched, kept per capture, then per graph and
//! per instantiation, so that a replay is checked and recorded like eager work — one operation on
//! the launch stream touching everything its nodes touch.
//!
//! | step | what the sanitizer keeps |
//! |---|---|
//! | work recorded into capture `c` (forwarded unchecked: it does not run now) | its touches, under `c` |
//! | capture `c` ends with graph `g` (or fails) | the touches move to `g` (or are dropped) |
//! | `g` instantiated as `x` | `x` shares `g`'s touches |
//! | `x` launched on stream `s` | ordered after `x`'s previous launch, whatever its stream (as CUDA runs them); checked and recorded on `s` as "a graph replay" (a race with unordered work is reported as for any enqueue; bytes freed into a pool live graphs hold are the graph's to touch) |
//! | `x` launched inside capture `c'` | its touches join `c'`'s |
//! | `g` / `x` destroyed | forgotten |

use std::collections::HashMap;

use super::{Sanitizer, Touch};
use crate::driver::{GraphExecId, GraphId};
use crate::sync::os::{Arc, Mutex};

/// The touches of captures under way, of graphs and of their instantiations.
#[derive(Debug, Default)]
pub(crate) struct GraphTouches {
    tables: Mutex<Tables>,
}

/// What a graph's capture touched, and when it ended: the allocation counter then (a replay
/// into bytes handed out since is a hazard; one into bytes handed out before is the graph's
/// input, captured knowingly).
#[derive(Clone, Debug)]
struct Captured {
    touches: Arc<[Touch]>,
    born: u64,
}

#[derive(Debug, Default)]
struct Tables {
    captures: HashMap<u64, Vec<Touch>>,
    graphs: HashMap<u64, Captured>,
    execs: HashMap<u64, Captured>,
}

impl Sanitizer {
    /// Work touching `touches` was recorded into capture `capture`.
    pub(crate) fn captured(&self, capture: u64, touches: &[Touch]) {
        self.graphs
            .tables
            .lock()
            .captures
            .entry(capture)
            .or_default()
            .extend_from_slice(touches);
    }

    /// Capture `capture` ended, with `graph` when it made one.
    pub(crate) fn capture_ended(&self, capture: u64, graph: Option<GraphId>) {
        let born = self.state.lock().next_allocation;
        let mut t = self.graphs.tables.lock();
        let touches = t.captures.remove(&capture).unwrap_or_default();
        if let Some(graph) = graph {
            let touches = touches.into();
            t.graphs.insert(graph.0, Captured { touches, born });
        }
    }

    /// `graph` was instantiated as `exec`.
    pub(crate) fn graph_instantiated(&self, graph: GraphId, exec: GraphExecId) {
        let mut t = self.graphs.tables.lock();
        let captured = t.graphs.get(&graph.0).cloned().unwrap_or(Captured {
            touches: Arc::from([]),
            born: 0,
        });
        t.execs.insert(exec.0, captured);
    }

    /// What a launch of `exec` touches, and the allocation counter when its capture ended.
    pub(crate) fn exec_touches(&self, exec: GraphExecId) -> (Arc<[Touch]>, u64) {
        self.graphs
            .tables
            .lock()
            .execs
            .get(&exec.0)
            .map_or_else(|| (Arc::from([]), 0), |c| (Arc::clone(&c.touches), c.born))
    }

    /// `graph` was destroyed.
    pub(crate) fn graph_destroyed(&self, graph: GraphId) {
        self.graphs.tables.lock().graphs.remove(&graph.0);
    }

    /// `exec` was destroyed.
    pub(crate) fn exec_destroyed(&self, exec: GraphExecId) {
        self.graphs.tables.lock().execs.remove(&exec.0);
        self.state.lock().launches.remove(&exec.0);
    }
}
