//! A tensor-library step captured once as a graph and replayed 1,000 times: the allocations the
//! step makes while captured come from the graph's private pool, so every replay writes the same
//! addresses, and nothing outside the pool is ever handed that memory while the graph lives.
//!
//! The step is `out = relu(x * w + b)` on bytes (saturating), with a temporary freed inside the
//! step — host kernels on the host backend. Each replay gets a fresh input copied into the static
//! input buffer first, and its output is checked against the same arithmetic on the CPU.
//!
//! ```text
//! cargo run --example cuda_graph
//! ```

use std::sync::Arc;

use cudalloc::{
    backend::HostDriver, backend::HostKernelMemory, backend::HostRange, graph::CaptureMode,
    DeviceAddr, Error, Result, Runtime, Storage, StreamId,
};

const LEN: u64 = 4096;
const REPLAYS: u64 = 1000;

fn host(runtime: &Runtime) -> Result<&HostDriver> {
    runtime.driver().as_host().ok_or_else(|| {
        Error::InvalidArgument(
            "the step's kernels are host kernels: run on the host backend".into(),
        )
    })
}

/// `dst[i] = f(a[i], b[i])` as a host kernel on `stream`.
fn binary(
    runtime: &Runtime,
    stream: StreamId,
    dst: DeviceAddr,
    a: DeviceAddr,
    b: DeviceAddr,
    f: fn(u8, u8) -> u8,
) -> Result<()> {
    // SAFETY: the kernel's ranges are memory this program owns and orders on its streams; no typed kernel sees them.
    unsafe {
        host(runtime)?.enqueue_host(
            stream,
            [
                HostRange::read(a, LEN),
                HostRange::read(b, LEN),
                HostRange::write(dst, LEN),
            ],
            move |m: &mut HostKernelMemory<3>| {
                let (mut x, mut y) = (vec![0u8; m.len(0) as usize], vec![0u8; m.len(1) as usize]);
                m.read(0, 0, &mut x)?;
                m.read(1, 0, &mut y)?;
                let out: Vec<u8> = x.iter().zip(&y).map(|(&p, &q)| f(p, q)).collect();
                m.write(2, 0, &out)
            },
        )
    }
}

fn mul(p: u8, q: u8) -> u8 {
    p.saturating_mul(q)
}

fn add_relu(p: u8, q: u8) -> u8 {
    // Bytes as signed values: relu clamps the negative half to zero.
    let s = (p as i8).saturating_add(q as i8);
    s.max(0) as u8
}

/// The step, as a tensor library would write it: allocates its temporary and its output.
fn step(
    runtime: &Arc<Runtime>,
    stream: StreamId,
    x: &Storage,
    w: &Storage,
    b: &Storage,
) -> Result<Storage> {
    let h = Storage::new_on(runtime, stream, LEN)?;
    binary(
        runtime,
        stream,
        h.mutable_data_ptr_on(stream)?,
        x.data_ptr_on(stream)?,
        w.data_ptr_on(stream)?,
        mul,
    )?;
    let out = Storage::new_on(runtime, stream, LEN)?;
    binary(
        runtime,
        stream,
        out.mutable_data_ptr_on(stream)?,
        h.data_ptr_on(stream)?,
        b.data_ptr_on(stream)?,
        add_relu,
    )?;
    // `h` is dropped here, inside the capture: its block goes back to the graph's pool.
    Ok(out)
}

fn input(round: u64) -> Vec<u8> {
    (0..LEN)
        .map(|i| (i.wrapping_mul(31).wrapping_add(round * 7) % 251) as u8)
        .collect()
}

fn main() -> Result<()> {
    let runtime = cudalloc::GLOBAL.get()?;
    let stream = runtime.create_stream(0)?;
    // The step's stream is current: storages' copies run on it, ordered with the replays.
    let _on = runtime.set_current_stream(stream)?;
    let (weights, bias): (Vec<u8>, Vec<u8>) = (
        (0..LEN).map(|i| (i % 5) as u8).collect(),
        (0..LEN).map(|i| (i % 200) as u8).collect(),
    );
    let x = Storage::new_on(runtime, stream, LEN)?;
    let w = Storage::new_on(runtime, stream, LEN)?;
    let b = Storage::new_on(runtime, stream, LEN)?;
    w.copy_from_host(stream, 0, &weights)?;
    b.copy_from_host(stream, 0, &bias)?;
    x.copy_from_host(stream, 0, &input(0))?;

    let capture = runtime.begin_capture(stream, None, CaptureMode::Global)?;
    let out = step(runtime, stream, &x, &w, &b)?;
    let graph = capture.end()?;
    let pool = graph.pool().clone();
    let layout = pool.snapshot()?.segments;
    println!(
        "captured: {} nodes, output at {:#x}, graph pool {} ({} segment(s), {} bytes allocated)",
        graph.node_count(),
        out.unordered_data_ptr().0,
        pool.id(),
        layout.len(),
        pool.memory_stats(0)?.allocated_bytes.all.current
    );

    let mut got = vec![0u8; LEN as usize];
    for round in 0..REPLAYS {
        let fresh = input(round + 1);
        x.copy_from_host(stream, 0, &fresh)?;
        graph.replay(stream)?;
        out.copy_to_host(stream, 0, &mut got)?;
        let want: Vec<u8> = fresh
            .iter()
            .zip(&weights)
            .zip(&bias)
            .map(|((&p, &q), &r)| add_relu(mul(p, q), r))
            .collect();
        if got != want {
            return Err(Error::InvalidArgument(format!(
                "replay {round}: the output is wrong"
            )));
        }
        // Eager work between replays never gets the graph's memory.
        let eager = Storage::new_on(runtime, stream, LEN)?;
        if pool.snapshot()?.segments.iter().any(|s| {
            s.blocks.iter().any(|b| {
                b.addr <= eager.unordered_data_ptr().0
                    && eager.unordered_data_ptr().0 < b.addr + b.size
            })
        }) {
            return Err(Error::InvalidArgument(format!(
                "replay {round}: an eager tensor got graph memory"
            )));
        }
    }
    let stable = pool.snapshot()?.segments == layout;
    let stats = runtime.memory_stats(0)?;
    println!(
        "replayed {REPLAYS} times: outputs checked, addresses stable: {stable}; device: {} bytes \
         allocated, {} reserved; graph pool: {} allocated",
        stats.allocated_bytes.all.current,
        stats.reserved_bytes.all.current,
        pool.memory_stats(0)?.allocated_bytes.all.current
    );
    if !stable {
        return Err(Error::InvalidArgument(
            "the graph's pool changed across replays".into(),
        ));
    }
    println!("verdict: ok");
    Ok(())
}
