//! A tiny tensor type whose cross-stream copy must call `record_stream` — and a test that catches
//! the bug when it does not, on a laptop, through the host backend's host kernels.
//!
//! The copy runs on a side stream; the source tensor is dropped right after the copy is queued.
//! Without `record_stream`, the source's block goes back to the cache at once, the next tensor of
//! the same size on the main stream gets it and writes it, and the copy — still queued on the side
//! stream — reads the newcomer's bytes. With `record_stream`, the block waits for the side stream.
//! The side stream is held at a gate (a host-backend test facility) while this happens, so the
//! outcome is the same on every run: no sleeps, no timing.
//!
//! Under the stream sanitizer the bug needs no gate and no reuse to show: the hand-out of the
//! source's block to the newcomer, while the side stream's copy was not ordered before the free,
//! is reported as a use after free at once (`copy_then_reuse(How::Raw, true)`).
//!
//! ```text
//! cargo run --example record_stream     # shows both outcomes
//! cargo test --examples                 # the tests below
//! ```

use std::sync::Arc;

use cudalloc::{
    backend::EventFlags, backend::HostDriver, sanitizer::Sanitize, sanitizer::SanitizeOptions,
    Error, ErrorKind, Result, Runtime, Storage, StreamId,
};
use cudalloc::{backend::HostKernelMemory, backend::HostRange};

/// How a copy on another stream orders itself against the source's producer and free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum How {
    /// A wait written, `record_stream` forgotten, on the raw address.
    Raw,
    /// A wait and `record_stream` written, on the raw address.
    Recorded,
    /// Through the storage's door for the stream: nothing written.
    Door,
}

/// A one-dimensional tensor of bytes on one stream.
struct Tensor {
    storage: Storage,
    stream: StreamId,
}

impl Tensor {
    fn host(runtime: &Runtime) -> Result<&HostDriver> {
        runtime.driver().as_host().ok_or_else(|| {
            Error::InvalidArgument("these kernels are host kernels: run on the host backend".into())
        })
    }

    /// A tensor of `len` bytes equal to `value`, written by a host kernel on `stream`.
    fn full(runtime: &Arc<Runtime>, stream: StreamId, len: u64, value: u8) -> Result<Tensor> {
        let storage = Storage::new_on(runtime, stream, len)?;
        // SAFETY: the kernel's ranges are memory this program owns and orders on its streams; no typed kernel sees them.
        unsafe {
            Self::host(runtime)?.enqueue_host(
                stream,
                [HostRange::write(storage.mutable_data_ptr_on(stream)?, len)],
                move |m: &mut HostKernelMemory<1>| m.write(0, 0, &vec![value; m.len(0) as usize]),
            )
        }?;
        Ok(Tensor { storage, stream })
    }

    /// A copy made on `side`. `Raw` and `Recorded` take the source's raw address, so the library
    /// waits for the producer itself — `Recorded` also remembers `record_stream`, `Raw` forgets
    /// it. `Door` is a typed host kernel over the two storages and writes neither: the storages
    /// order themselves (`stream_order:auto`, the default).
    fn copy_on(&self, side: StreamId, how: How) -> Result<Tensor> {
        let runtime = self.storage.runtime();
        let driver = runtime.driver();
        let len = self.storage.nbytes();
        let out = Storage::new_on(runtime, side, len)?;
        if how == How::Door {
            // A typed kernel: both storages seen as slices, each ordered by its storage.
            runtime.launch_host(
                side,
                (self.storage.reads::<u8>(), out.writes::<u8>()),
                |(src, dst)| {
                    dst.copy_from_slice(src);
                    Ok(())
                },
            )?;
            return Ok(Tensor {
                storage: out,
                stream: side,
            });
        }
        let ready = driver.event_create(0, EventFlags::default())?;
        driver.event_record(ready, self.stream)?;
        driver.stream_wait_event(side, ready)?;
        driver.event_destroy(ready)?;
        let src = self.storage.unordered_data_ptr();
        // SAFETY: raw ranges, as PyTorch's rules would have them; this example's kernels on them
        // are all raw (no typed kernel sees these bytes).
        unsafe {
            Self::host(runtime)?.enqueue_host(
                side,
                [
                    HostRange::read(src, len),
                    HostRange::write(out.mutable_data_ptr_on(side)?, len),
                ],
                |m: &mut HostKernelMemory<2>| {
                    let bytes = m.to_vec(0)?;
                    m.write(1, 0, &bytes)
                },
            )
        }?;
        if how == How::Recorded {
            self.storage.record_stream(side)?;
        }
        Ok(Tensor {
            storage: out,
            stream: side,
        })
    }

    fn to_vec(&self) -> Result<Vec<u8>> {
        let mut out = vec![0; self.storage.nbytes() as usize];
        self.storage.copy_to_host(self.stream, 0, &mut out)?;
        Ok(out)
    }
}

/// Copies a tensor of 7s on a side stream, drops it, makes a tensor of 9s of the same size on the
/// main stream, then lets the side stream run. Returns the bytes of the copy. With `sanitize`,
/// the stream sanitizer checks every step (and reports the forgotten `record_stream`).
fn copy_then_reuse(how: How, sanitize: bool) -> Result<Vec<u8>> {
    let host = Arc::new(HostDriver::builder().memory_per_device(64 << 20).build()?);
    let checked = if sanitize {
        Sanitize::On(SanitizeOptions::default())
    } else {
        Sanitize::Off
    };
    let runtime = Arc::new(Runtime::builder().sanitize(checked).build(host.clone())?);
    let main = runtime.default_stream(0)?;
    let side = runtime.create_stream(0)?;
    let gate = host.gate_stream(side)?; // the side stream is busy for now
    let source = Tensor::full(&runtime, main, 1 << 20, 7)?;
    let copy = source.copy_on(side, how)?;
    drop(source);
    let newcomer = Tensor::full(&runtime, main, 1 << 20, 9)?;
    runtime.driver().stream_synchronize(main)?;
    drop(gate); // the side stream runs the copy now
    let bytes = copy.to_vec()?;
    drop(newcomer);
    Ok(bytes)
}

fn main() -> Result<()> {
    for how in [How::Raw, How::Recorded, How::Door] {
        let bytes = copy_then_reuse(how, false)?;
        let wrong = bytes.iter().filter(|&&b| b != 7).count();
        println!(
            "{}: the copy holds {wrong} wrong bytes of {}",
            match how {
                How::Raw => "record_stream forgotten         ",
                How::Recorded => "record_stream called            ",
                How::Door => "the storage's door, nothing said",
            },
            bytes.len()
        );
    }
    match copy_then_reuse(How::Raw, true) {
        Err(err) if err.kind() == ErrorKind::StreamRace => {
            println!("record_stream forgotten, sanitizer on: reported —\n{err}")
        }
        other => {
            return Err(Error::InvalidArgument(format!(
                "the sanitizer missed the forgotten record_stream: {other:?}"
            )))
        }
    }
    copy_then_reuse(How::Recorded, true)?;
    println!("record_stream called, sanitizer on: nothing reported");
    copy_then_reuse(How::Door, true)?;
    println!("the storage's door, sanitizer on: nothing reported");
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn forgetting_record_stream_is_caught() {
        let bytes = copy_then_reuse(How::Raw, false).unwrap();
        assert!(
            bytes.iter().all(|&b| b == 9),
            "the copy read the reused block: the newcomer's 9s"
        );
    }

    #[test]
    fn with_record_stream_the_copy_is_right() {
        let bytes = copy_then_reuse(How::Recorded, false).unwrap();
        assert!(bytes.iter().all(|&b| b == 7));
    }

    #[test]
    fn the_sanitizer_reports_the_forgotten_record_stream_and_only_that() {
        let err = copy_then_reuse(How::Raw, true).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::StreamRace, "{err}");
        assert!(err.to_string().contains("use after free"), "{err}");
        copy_then_reuse(How::Recorded, true).unwrap();
    }

    #[test]
    fn through_the_storages_door_nothing_is_forgotten() {
        let bytes = copy_then_reuse(How::Door, false).unwrap();
        assert!(bytes.iter().all(|&b| b == 7));
        copy_then_reuse(How::Door, true).unwrap();
    }
}
