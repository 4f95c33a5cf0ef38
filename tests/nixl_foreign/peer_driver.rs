//! Drives the foreign NIXL peer (`peer.py` beside this file, a Python program on the nixl
//! wheel's API only) line by line: shared by `tests/nixl_foreign.rs` and `benches/nixl.rs`.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

/// The variable naming a Python with the nixl wheel and numpy.
pub(crate) const PYTHON_VAR: &str = "CUDALLOC_NIXL_PYTHON";

/// The foreign peer, a Python process.
pub(crate) struct Peer {
    /// The Python process.
    pub child: Child,
    input: ChildStdin,
    /// Its answers.
    pub output: BufReader<ChildStdout>,
}

impl Peer {
    /// A peer named `name`; panics without a usable Python (the peer is the point).
    pub(crate) fn spawn(name: &str) -> Peer {
        Self::start(name, None)
    }

    /// A peer running NIXL's metadata listener on `port`.
    pub(crate) fn spawn_listening(name: &str, port: u16) -> Peer {
        Self::start(name, Some(port))
    }

    fn start(name: &str, listen: Option<u16>) -> Peer {
        let python = std::env::var(PYTHON_VAR).unwrap_or_else(|_| {
            panic!(
                "{PYTHON_VAR} must name a Python with the nixl wheel and numpy (the foreign peer \
                 is the point of this suite; .ci/run sets it)"
            )
        });
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/nixl_foreign/peer.py");
        let mut command = Command::new(&python);
        command.arg(script).arg(name);
        if let Some(port) = listen {
            command.arg(port.to_string());
        }
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting the foreign peer with {python}: {e}"));
        let input = child.stdin.take().unwrap();
        let output = BufReader::new(child.stdout.take().unwrap());
        Peer {
            child,
            input,
            output,
        }
    }

    /// Sends one command line.
    pub(crate) fn send(&mut self, line: &str) {
        writeln!(self.input, "{line}").unwrap();
        self.input.flush().unwrap();
    }

    /// The next answer, which must start with `word`; its rest.
    pub(crate) fn expect(&mut self, word: &str) -> String {
        let mut line = String::new();
        self.output.read_line(&mut line).unwrap();
        let line = line.trim_end();
        match line.split_once(' ') {
            Some((w, rest)) if w == word => rest.to_owned(),
            _ if line == word => String::new(),
            _ => panic!("the foreign peer answered {line:?} where {word} was expected"),
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = writeln!(self.input, "QUIT");
        let _ = self.child.wait();
    }
}
