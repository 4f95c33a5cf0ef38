//! A bounded reader of pickles (protocols 2 to 5): what a PyTorch memory snapshot is.
//!
//! The pickle machine runs as a loop over opcodes with an explicit stack — no recursion, whatever
//! the nesting. Values live in one arena and containers refer to their items by index, so a memo
//! reference (`BINGET`, `DUP`) costs an index, never a copy: a few hundred bytes cannot expand
//! into a tree of billions of nodes. Strings and bytes are ranges of the input (a length prefix is
//! checked against the bytes left before anything is taken). Nesting is counted as containers get
//! their items ([`MAX_PICKLE_DEPTH`]; a container changed after it was nested elsewhere is not
//! re-counted — nothing here walks values recursively, so that is harmless), and the arena, the
//! items, the stack and the memo together stay within the memory budget
//! ([`PICKLE_MEMORY_RATIO`] × the pickle's bytes, at least [`PICKLE_MEMORY_FLOOR`], at most
//! [`MAX_PICKLE_MEMORY`]). The arena is dropped flat.
//!
//! Supported: the opcodes that pickle dicts, lists, tuples, sets, strings, bytes, integers,
//! floats, booleans and `None` with protocols 2 to 5 (framing, the memo). Refused with an error
//! naming the opcode: anything that constructs objects (`GLOBAL`, `REDUCE`, …) and the text
//! opcodes of protocols 0 and 1. A memory snapshot needs nothing else.

use std::collections::HashMap;
use std::mem::size_of;

use super::limits::{
    bad, exceeded, MAX_PICKLE_DEPTH, MAX_PICKLE_MEMORY, PICKLE_MEMORY_FLOOR, PICKLE_MEMORY_RATIO,
};
use crate::error::{Error, Result};

/// A value's index in the arena.
pub(super) type Id = u32;

/// One value of a pickle.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer above `i64::MAX` that fits a `u64`.
    UInt(u64),
    /// An integer that fits neither.
    Big,
    Float(f64),
    /// Text: `len` bytes of the input at `at`.
    Str {
        at: u32,
        len: u32,
    },
    /// Bytes: `len` bytes of the input at `at`.
    Bytes {
        at: u32,
        len: u32,
    },
    /// Containers: an index into the containers.
    List(u32),
    Tuple(u32),
    Dict(u32),
    Set(u32),
}

/// The items of a container (a dict's are keys and values, alternating) and its nesting depth.
#[derive(Debug)]
struct Container {
    items: Vec<Id>,
    depth: u32,
}

/// A pickle read into memory: its root value and what it refers to.
#[derive(Debug)]
pub(super) struct Pickle<'a> {
    input: &'a [u8],
    values: Vec<Value>,
    containers: Vec<Container>,
    /// The value `STOP` returned.
    pub root: Id,
}

impl Pickle<'_> {
    /// The value `id`.
    pub(super) fn value(&self, id: Id) -> Value {
        self.values.get(id as usize).copied().unwrap_or(Value::None)
    }

    fn items(&self, c: u32) -> &[Id] {
        self.containers
            .get(c as usize)
            .map_or(&[][..], |c| &c.items[..])
    }

    /// A dict's keys and values, alternating.
    pub(super) fn dict(&self, id: Id) -> Option<&[Id]> {
        match self.value(id) {
            Value::Dict(c) => Some(self.items(c)),
            _ => None,
        }
    }

    /// A list's or a tuple's items.
    pub(super) fn list(&self, id: Id) -> Option<&[Id]> {
        match self.value(id) {
            Value::List(c) | Value::Tuple(c) => Some(self.items(c)),
            _ => None,
        }
    }

    /// The bytes of a string (or of bytes).
    pub(super) fn text(&self, id: Id) -> Option<&[u8]> {
        match self.value(id) {
            Value::Str { at, len } | Value::Bytes { at, len } => {
                self.input.get(at as usize..at as usize + len as usize)
            }
            _ => None,
        }
    }

    /// A non-negative integer that fits a `u64`.
    pub(super) fn uint(&self, id: Id) -> Option<u64> {
        match self.value(id) {
            Value::Int(i) => u64::try_from(i).ok(),
            Value::UInt(u) => Some(u),
            _ => None,
        }
    }

    /// The value under the string key `key` in the dict items `items` (the last, as in Python).
    pub(super) fn get(&self, items: &[Id], key: &str) -> Option<Id> {
        items
            .chunks_exact(2)
            .rev()
            .find(|kv| self.text(kv[0]) == Some(key.as_bytes()))
            .map(|kv| kv[1])
    }
}

/// Reads the pickle in `input`.
pub(super) fn read(input: &[u8]) -> Result<Pickle<'_>> {
    let budget = (input.len() as u64)
        .saturating_mul(PICKLE_MEMORY_RATIO)
        .clamp(PICKLE_MEMORY_FLOOR, MAX_PICKLE_MEMORY);
    let mut m = Machine {
        input,
        pos: 0,
        values: Vec::new(),
        containers: Vec::new(),
        items: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        budget,
    };
    let root = m.run()?;
    Ok(Pickle {
        input,
        values: m.values,
        containers: m.containers,
        root,
    })
}

fn pickle(what: impl std::fmt::Display) -> Error {
    bad(format!("pickle: {what}"))
}

fn no_memory() -> Error {
    pickle("cannot allocate memory for the values read")
}

/// Makes room for `n` more elements of `v` without aborting on a failed allocation.
fn room<T>(v: &mut Vec<T>, n: usize) -> Result<()> {
    v.try_reserve(n).map_err(|_| no_memory())
}

/// Kinds of containers, as opcodes name their targets.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Kind {
    List,
    Tuple,
    Dict,
    Set,
}

struct Machine<'a> {
    input: &'a [u8],
    pos: usize,
    values: Vec<Value>,
    containers: Vec<Container>,
    /// Items in all containers.
    items: u64,
    stack: Vec<Id>,
    /// Stack lengths at each open `MARK`.
    marks: Vec<usize>,
    memo: HashMap<u32, Id>,
    /// Bytes the structures above may hold.
    budget: u64,
}

impl Machine<'_> {
    /// Bytes held by the structures (by length, as counted against the budget).
    fn used(&self) -> u64 {
        self.values.len() as u64 * size_of::<Value>() as u64
            + self.containers.len() as u64 * size_of::<Container>() as u64
            + self.items * size_of::<Id>() as u64
            + self.stack.len() as u64 * size_of::<Id>() as u64
            + self.marks.len() as u64 * size_of::<usize>() as u64
            + self.memo.len() as u64 * 2 * size_of::<u32>() as u64
    }

    fn run(&mut self) -> Result<Id> {
        loop {
            let at = self.pos;
            let op = self.byte()?;
            if let Some(root) = self.step(op, at)? {
                return Ok(root);
            }
            if self.used() > self.budget {
                return Err(exceeded(
                    format!(
                        "the pickle of {} bytes needs more than {} bytes of values (at byte {at})",
                        self.input.len(),
                        self.budget
                    ),
                    "PICKLE_MEMORY_RATIO",
                    format!(
                        "{PICKLE_MEMORY_RATIO}, with PICKLE_MEMORY_FLOOR = {PICKLE_MEMORY_FLOOR} \
                         and MAX_PICKLE_MEMORY = {MAX_PICKLE_MEMORY}"
                    ),
                ));
            }
        }
    }

    /// Runs opcode `op` (read at byte `at`); `Some(root)` at `STOP`.
    fn step(&mut self, op: u8, at: usize) -> Result<Option<Id>> {
        match op {
            0x80 => {
                let protocol = self.byte()?;
                if !(2..=5).contains(&protocol) {
                    return Err(pickle(format!(
                        "protocol {protocol} (protocols 2 to 5 are read)"
                    )));
                }
            }
            0x95 => {
                self.take(8)?; // FRAME: a length the reader does not need
            }
            b'.' => return self.pop().map(Some),
            b'(' => {
                room(&mut self.marks, 1)?;
                self.marks.push(self.stack.len());
            }
            b'0' => {
                if self.marks.last() == Some(&self.stack.len()) {
                    self.marks.pop();
                } else {
                    self.pop()?;
                }
            }
            b'1' => {
                let mark = self.pop_mark()?;
                self.stack.truncate(mark);
            }
            b'2' => {
                let top = self.top()?;
                self.push(top)?;
            }
            b'N' => self.scalar(Value::None)?,
            0x88 => self.scalar(Value::Bool(true))?,
            0x89 => self.scalar(Value::Bool(false))?,
            b'J' => {
                let b = self.array::<4>()?;
                self.scalar(Value::Int(i64::from(i32::from_le_bytes(b))))?;
            }
            b'K' => {
                let b = self.byte()?;
                self.scalar(Value::Int(i64::from(b)))?;
            }
            b'M' => {
                let b = self.array::<2>()?;
                self.scalar(Value::Int(i64::from(u16::from_le_bytes(b))))?;
            }
            0x8a => {
                let n = usize::from(self.byte()?);
                self.long(n)?;
            }
            0x8b => {
                let n = self.length::<4>()?;
                self.long(n)?;
            }
            b'G' => {
                let b = self.array::<8>()?;
                self.scalar(Value::Float(f64::from_be_bytes(b)))?;
            }
            // Text: BINUNICODE, SHORT_BINUNICODE, BINUNICODE8.
            b'X' | 0x8c | 0x8d => {
                let n = match op {
                    b'X' => self.length::<4>()?,
                    0x8c => usize::from(self.byte()?),
                    _ => self.length::<8>()?,
                };
                let (at, len) = self.span(n)?;
                self.scalar(Value::Str { at, len })?;
            }
            // Bytes: BINSTRING, SHORT_BINSTRING, BINBYTES, SHORT_BINBYTES, BINBYTES8, BYTEARRAY8.
            b'T' | b'U' | b'B' | b'C' | 0x8e | 0x96 => {
                let n = match op {
                    b'T' | b'B' => self.length::<4>()?,
                    b'U' | b'C' => usize::from(self.byte()?),
                    _ => self.length::<8>()?,
                };
                let (at, len) = self.span(n)?;
                self.scalar(Value::Bytes { at, len })?;
            }
            b']' => self.container(Kind::List, Vec::new())?,
            b'}' => self.container(Kind::Dict, Vec::new())?,
            b')' => self.container(Kind::Tuple, Vec::new())?,
            0x8f => self.container(Kind::Set, Vec::new())?,
            b'a' => {
                let item = self.pop()?;
                let target = self.top()?;
                self.add(target, Kind::List, &[item])?;
            }
            b's' => {
                let value = self.pop()?;
                let key = self.pop()?;
                let target = self.top()?;
                self.add(target, Kind::Dict, &[key, value])?;
            }
            // APPENDS, SETITEMS, ADDITEMS: the items above the mark go into the container below.
            b'e' | b'u' | 0x90 => {
                let mark = self.pop_mark()?;
                let kind = match op {
                    b'e' => Kind::List,
                    b'u' => Kind::Dict,
                    _ => Kind::Set,
                };
                let below = mark
                    .checked_sub(1)
                    .filter(|&i| self.marks.last().is_none_or(|&m| m <= i));
                let Some(target) = below.map(|i| self.stack[i]) else {
                    return Err(pickle(format!("byte {at}: nothing below the mark")));
                };
                let items: Vec<Id> = self.moved_items(mark)?;
                self.add(target, kind, &items)?;
            }
            // LIST, TUPLE, DICT, FROZENSET: a new container of the items above the mark.
            b'l' | b't' | b'd' | 0x91 => {
                let mark = self.pop_mark()?;
                let items = self.moved_items(mark)?;
                let kind = match op {
                    b'l' => Kind::List,
                    b't' => Kind::Tuple,
                    b'd' => Kind::Dict,
                    _ => Kind::Set,
                };
                self.container(kind, items)?;
            }
            // TUPLE1, TUPLE2, TUPLE3.
            0x85..=0x87 => {
                let n = usize::from(op - 0x84);
                let from = self
                    .stack
                    .len()
                    .checked_sub(n)
                    .ok_or_else(|| self.underflow(at))?;
                if self.marks.last().is_some_and(|&m| m > from) {
                    return Err(self.underflow(at));
                }
                let items = self.moved_items(from)?;
                self.container(Kind::Tuple, items)?;
            }
            b'q' | b'r' | 0x94 => {
                let index = match op {
                    b'q' => u32::from(self.byte()?),
                    b'r' => u32::from_le_bytes(self.array::<4>()?),
                    _ => u32::try_from(self.memo.len()).map_err(|_| no_memory())?,
                };
                let top = self.top()?;
                self.memo.try_reserve(1).map_err(|_| no_memory())?;
                self.memo.insert(index, top);
            }
            b'h' | b'j' => {
                let index = match op {
                    b'h' => u32::from(self.byte()?),
                    _ => u32::from_le_bytes(self.array::<4>()?),
                };
                let value = *self.memo.get(&index).ok_or_else(|| {
                    pickle(format!("byte {at}: memo entry {index} was never put"))
                })?;
                self.push(value)?;
            }
            other => {
                return Err(pickle(format!(
                    "opcode {other:#04x} ({:?}) at byte {at} is not read here: a memory snapshot \
                     holds only dicts, lists, tuples, strings and numbers, pickled with protocol \
                     2 or later",
                    char::from(other)
                )))
            }
        }
        Ok(None)
    }

    fn byte(&mut self) -> Result<u8> {
        let b = *self
            .input
            .get(self.pos)
            .ok_or_else(|| pickle("truncated (no STOP opcode)"))?;
        self.pos += 1;
        Ok(b)
    }

    /// The next `n` bytes, checked against what is left first.
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let left = self.input.len() - self.pos;
        if n > left {
            return Err(pickle(format!(
                "a length of {n} bytes at byte {} runs past the end ({left} bytes left)",
                self.pos
            )));
        }
        let bytes = &self.input[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    /// A little-endian length prefix of `N` bytes.
    fn length<const N: usize>(&mut self) -> Result<usize> {
        let b = self.array::<N>()?;
        let mut wide = [0u8; 8];
        wide[..N].copy_from_slice(&b);
        usize::try_from(u64::from_le_bytes(wide)).map_err(|_| pickle("a length past usize"))
    }

    /// The input range of the next `n` bytes.
    fn span(&mut self, n: usize) -> Result<(u32, u32)> {
        let at = self.pos;
        self.take(n)?;
        let fit = |v: usize| u32::try_from(v).map_err(|_| pickle("a string past 4 GiB"));
        Ok((fit(at)?, fit(n)?))
    }

    /// A little-endian two's-complement integer of `n` bytes (`LONG1`, `LONG4`).
    fn long(&mut self, n: usize) -> Result<()> {
        let bytes = self.take(n)?;
        let value = if n <= 16 {
            let fill = if bytes.last().is_some_and(|&b| b & 0x80 != 0) {
                0xff
            } else {
                0
            };
            let mut wide = [fill; 16];
            wide[..n].copy_from_slice(bytes);
            let v = i128::from_le_bytes(wide);
            match (i64::try_from(v), u64::try_from(v)) {
                (Ok(i), _) => Value::Int(i),
                (_, Ok(u)) => Value::UInt(u),
                _ => Value::Big,
            }
        } else {
            Value::Big
        };
        self.scalar(value)
    }

    fn underflow(&self, at: usize) -> Error {
        pickle(format!("byte {at}: the stack holds too few values"))
    }

    fn pop(&mut self) -> Result<Id> {
        if self.marks.last() == Some(&self.stack.len()) {
            return Err(pickle(format!(
                "byte {}: a value taken across a mark",
                self.pos
            )));
        }
        self.stack
            .pop()
            .ok_or_else(|| pickle(format!("byte {}: the stack is empty", self.pos)))
    }

    fn top(&self) -> Result<Id> {
        match self.stack.last() {
            Some(&v) if self.marks.last() != Some(&self.stack.len()) => Ok(v),
            _ => Err(pickle(format!("byte {}: no value on the stack", self.pos))),
        }
    }

    fn pop_mark(&mut self) -> Result<usize> {
        self.marks
            .pop()
            .ok_or_else(|| pickle(format!("byte {}: no mark to pop", self.pos)))
    }

    fn push(&mut self, v: Id) -> Result<()> {
        room(&mut self.stack, 1)?;
        self.stack.push(v);
        Ok(())
    }

    /// The stack's values from `from` on, taken off it.
    fn moved_items(&mut self, from: usize) -> Result<Vec<Id>> {
        let mut items = Vec::new();
        room(&mut items, self.stack.len() - from)?;
        items.extend(self.stack.drain(from..));
        Ok(items)
    }

    fn new_value(&mut self, value: Value) -> Result<Id> {
        let id = Id::try_from(self.values.len()).map_err(|_| no_memory())?;
        room(&mut self.values, 1)?;
        self.values.push(value);
        Ok(id)
    }

    fn scalar(&mut self, value: Value) -> Result<()> {
        let id = self.new_value(value)?;
        self.push(id)
    }

    fn depth_of(&self, id: Id) -> u32 {
        match self.values.get(id as usize) {
            Some(Value::List(c) | Value::Tuple(c) | Value::Dict(c) | Value::Set(c)) => {
                self.containers.get(*c as usize).map_or(0, |c| c.depth)
            }
            _ => 0,
        }
    }

    /// The depth of a container holding `items` (at least `depth`), checked against the limit.
    fn depth_with(&self, depth: u32, items: &[Id]) -> Result<u32> {
        let deepest = items.iter().map(|&i| self.depth_of(i)).max().unwrap_or(0);
        let depth = depth.max(deepest + 1);
        if depth as usize > MAX_PICKLE_DEPTH {
            return Err(exceeded(
                format!("containers nested more than {MAX_PICKLE_DEPTH} deep"),
                "MAX_PICKLE_DEPTH",
                MAX_PICKLE_DEPTH,
            ));
        }
        Ok(depth)
    }

    /// Pushes a new container of `kind` holding `items`.
    fn container(&mut self, kind: Kind, items: Vec<Id>) -> Result<()> {
        if kind == Kind::Dict && !items.len().is_multiple_of(2) {
            return Err(pickle(format!(
                "byte {}: a dict of an odd number of items",
                self.pos
            )));
        }
        let depth = self.depth_with(1, &items)?;
        let c = u32::try_from(self.containers.len()).map_err(|_| no_memory())?;
        room(&mut self.containers, 1)?;
        self.items += items.len() as u64;
        self.containers.push(Container { items, depth });
        self.scalar(match kind {
            Kind::List => Value::List(c),
            Kind::Tuple => Value::Tuple(c),
            Kind::Dict => Value::Dict(c),
            Kind::Set => Value::Set(c),
        })
    }

    /// Adds `items` to the container `target`, which must be of `kind`.
    fn add(&mut self, target: Id, kind: Kind, items: &[Id]) -> Result<()> {
        let c = match (kind, self.values.get(target as usize)) {
            (Kind::List, Some(Value::List(c)))
            | (Kind::Dict, Some(Value::Dict(c)))
            | (Kind::Set, Some(Value::Set(c))) => *c as usize,
            _ => {
                return Err(pickle(format!(
                    "byte {}: items for a {kind:?} given to something else",
                    self.pos
                )))
            }
        };
        if kind == Kind::Dict && !items.len().is_multiple_of(2) {
            return Err(pickle(format!("byte {}: a key without a value", self.pos)));
        }
        let depth = self.depth_with(self.containers[c].depth, items)?;
        let container = &mut self.containers[c];
        room(&mut container.items, items.len())?;
        container.items.extend_from_slice(items);
        container.depth = depth;
        self.items += items.len() as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_serde_pickle_writes() {
        use serde_pickle::{HashableValue as H, Value as V};
        let mut entry = std::collections::BTreeMap::new();
        entry.insert(H::String("addr".into()), V::I64(1 << 40));
        entry.insert(H::String("big".into()), V::Int((u64::MAX).into()));
        entry.insert(H::String("neg".into()), V::I64(-3));
        entry.insert(H::String("f".into()), V::F64(1.5));
        entry.insert(
            H::String("t".into()),
            V::Tuple(vec![V::I64(0), V::Bool(true)]),
        );
        let top = V::List(vec![V::Dict(entry), V::None, V::Bytes(vec![1, 2])]);
        let bytes = serde_pickle::value_to_vec(&top, serde_pickle::SerOptions::new()).unwrap();
        let p = read(&bytes).unwrap();
        let list = p.list(p.root).unwrap();
        assert_eq!(list.len(), 3);
        let d = p.dict(list[0]).unwrap();
        assert_eq!(p.uint(p.get(d, "addr").unwrap()), Some(1 << 40));
        assert_eq!(p.uint(p.get(d, "big").unwrap()), Some(u64::MAX));
        assert_eq!(p.value(p.get(d, "neg").unwrap()), Value::Int(-3));
        assert_eq!(p.value(p.get(d, "f").unwrap()), Value::Float(1.5));
        assert_eq!(p.list(p.get(d, "t").unwrap()).map(<[_]>::len), Some(2));
        assert_eq!(p.value(list[1]), Value::None);
        assert_eq!(p.text(list[2]), Some(&[1u8, 2][..]));
    }

    #[test]
    fn memo_references_share_instead_of_copying() {
        // L0 = []; L(n+1) = [Ln] * 200, 8 times: 200^8 leaves as a tree, a few KB as a pickle.
        let mut p = vec![0x80, 4, b']', 0x94];
        for level in 0..8u8 {
            p.push(b'(');
            for _ in 0..200 {
                p.extend_from_slice(&[b'h', level]);
            }
            p.extend_from_slice(&[b'l', 0x94]);
        }
        p.push(b'.');
        let read = read(&p).unwrap();
        assert_eq!(read.list(read.root).map(<[_]>::len), Some(200));
    }
}
