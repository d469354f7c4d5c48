//! A strict reader for the pickles the Python folder2lmdb scripts store: `(image_bytes, label)`
//! tuples, an `int` (`__len__`), and a list of `bytes` keys (`__keys__`), as written by
//! `pickle.dumps` with any protocol (0 to 5), by Python 3 or Python 2, with the label a Python
//! `int` or a NumPy integer scalar (`np.int64(7)`, what a label taken from a NumPy array is).
//!
//! Nothing in a pickle is run. The opcodes that build values (bytes, strings, ints, tuples,
//! lists, the memo) are interpreted; the few calls those objects need are recognised by name
//! and evaluated here instead: `_codecs.encode(text, "latin1")` (how protocols 0 to 2 store
//! `bytes`), `bytes()`, `numpy.dtype(...)` of an integer type and `numpy.core.multiarray.scalar`
//! (`numpy._core` in NumPy 2) of it. Any other call is an error naming it. Byte strings stored as
//! such (protocols 3 to 5, Python 2's `str`) are returned as ranges into the input, so reading an
//! image is still zero-copy; the latin-1 and escaped forms are decoded into a new buffer. Text
//! and decoded bytes are shared (`Rc`), so the memo's copies of a value copy no text.

use std::collections::HashMap;
use std::ops::Range;
use std::rc::Rc;

/// A decoded value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// `bytes` stored as such: a range of the input.
    Bytes(Range<usize>),
    /// `bytes` that had to be decoded (a latin-1 or escaped text form).
    OwnedBytes(Rc<[u8]>),
    /// `str`.
    Str(Rc<str>),
    /// `int` (within i64), or a NumPy integer scalar.
    Int(i64),
    /// `tuple`.
    Tuple(Vec<Value>),
    /// `list`.
    List(Vec<Value>),
    /// A global a pickle names (a class or function), not called yet.
    Global(Rc<str>, Rc<str>),
    /// A NumPy integer dtype: signed or not, bytes, little-endian or not.
    IntDtype {
        /// Signed (`i`) or unsigned (`u`).
        signed: bool,
        /// Size in bytes (1, 2, 4 or 8).
        size: usize,
        /// Byte order: true for little-endian (`<`, `|`, `=` on the machines we run on).
        little: bool,
    },
    /// `None`, `True`, `False`, floats, dicts, sets (as they may appear in forks' extra fields):
    /// what kind, for messages only.
    Other(OtherKind),
}

/// Which of the values a label or image never is [`Value::Other`] stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtherKind {
    /// `None`.
    None,
    /// `True` or `False`.
    Bool,
    /// A `float`.
    Float,
    /// A `dict` (its items are dropped).
    Dict,
    /// A `set` (its items are dropped).
    Set,
    /// A `frozenset` (its items are dropped).
    FrozenSet,
}

impl Value {
    /// The bytes this value holds, when it is `bytes`.
    pub fn bytes<'a>(&'a self, data: &'a [u8]) -> Option<&'a [u8]> {
        match self {
            Value::Bytes(r) => data.get(r.clone()),
            Value::OwnedBytes(b) => Some(b),
            _ => None,
        }
    }
}

/// The deepest nesting of tuples and lists accepted (folder2lmdb pickles nest two deep).
const MAX_DEPTH: u32 = 32;

/// A value on the unpickler's stack, with what bounds it: how deeply it nests and how many
/// values it holds in all (itself included). Its text is shared, so a copy costs its values.
#[derive(Clone)]
struct Item {
    value: Value,
    depth: u32,
    nodes: usize,
}

impl Item {
    fn leaf(value: Value) -> Item {
        Item {
            value,
            depth: 0,
            nodes: 1,
        }
    }

    /// A tuple or list of `items`.
    fn container(items: Vec<Item>, list: bool) -> Result<Item, String> {
        let depth = 1 + items.iter().map(|i| i.depth).max().unwrap_or(0);
        if depth > MAX_DEPTH {
            return Err(format!("tuples or lists nested deeper than {MAX_DEPTH}"));
        }
        let nodes = 1 + items.iter().map(|i| i.nodes).sum::<usize>();
        let values = items.into_iter().map(|i| i.value).collect();
        Ok(Item {
            value: if list {
                Value::List(values)
            } else {
                Value::Tuple(values)
            },
            depth,
            nodes,
        })
    }

    /// Appends `items` to this list.
    fn extend(&mut self, items: Vec<Item>) -> Result<(), String> {
        let Value::List(list) = &mut self.value else {
            return Err("APPEND onto something that is not a list".into());
        };
        for item in items {
            if item.depth + 1 > MAX_DEPTH {
                return Err(format!("tuples or lists nested deeper than {MAX_DEPTH}"));
            }
            self.depth = self.depth.max(item.depth + 1);
            self.nodes += item.nodes;
            list.push(item.value);
        }
        Ok(())
    }
}

/// The items pushed since the last MARK, popped. A MARK above the stack's top (items popped
/// since by other opcodes, found by fuzzing) is an error, not a panic.
fn items_since_mark(
    stack: &mut Vec<Item>,
    marks: &mut Vec<usize>,
    op: &str,
) -> Result<Vec<Item>, String> {
    let mark = marks.pop().ok_or(format!("{op} without MARK"))?;
    if mark > stack.len() {
        return Err(format!("{op}: its MARK is above the stack's top"));
    }
    Ok(stack.split_off(mark))
}

/// What to say about a value this reader does not make, with what to do instead.
const CONVERT: &str = "this reader takes only bytes, str, int, NumPy integer scalars, tuples \
                       and lists; repack from the source images with `pack-dataset \
                       imagefolder2lmdb`, or rewrite the file with plain bytes images and int \
                       labels";

/// Decodes one pickle.
///
/// Everything the input can ask for is bounded by the input itself: a value is at most as big as
/// the bytes that describe it, memo references (`GET` and `DUP`, which copy tuples and lists
/// here, where Python would share them; text is shared) may not make the values outnumber the
/// input's bytes, memo stores (`PUT`, `MEMOIZE`) may not copy more than four values per input
/// byte, memo indices are only keys of a map (a `LONG_BINPUT` of 2³² − 1 allocates nothing), and
/// nesting stops at [`MAX_DEPTH`].
pub fn parse(data: &[u8]) -> Result<Value, String> {
    let mut machine = Machine::new(data);
    loop {
        let op = *data.get(machine.at).ok_or("pickle ends without STOP")?;
        machine.at += 1;
        if op == b'.' {
            return machine
                .stack
                .pop()
                .map(|item| item.value)
                .ok_or_else(|| "STOP on an empty stack".into());
        }
        machine.step(op)?;
    }
}

/// The pickle virtual machine's state while [`parse`] reads `data`, with the budgets that bound
/// what the input can make.
struct Machine<'a> {
    data: &'a [u8],
    /// The next opcode's position.
    at: usize,
    stack: Vec<Item>,
    marks: Vec<usize>,
    memo: HashMap<u32, Item>,
    /// Values made so far, clones included: never more than one per input byte (plus slack).
    budget: usize,
    made: usize,
    /// Values copied into the memo by PUT and MEMOIZE (which copy tuples and lists here too): a
    /// normal pickle stores each value once, and a container again inside each memoized one
    /// that holds it, so four times the budget leaves room and stays linear. Text is shared,
    /// not copied: protocol 0 memoizes an image's text, its bytes and the tuple holding them.
    stored: usize,
    /// Bytes made by calls (`_codecs.encode`): a normal pickle decodes each text once.
    decoded: usize,
}

impl<'a> Machine<'a> {
    fn new(data: &'a [u8]) -> Machine<'a> {
        Machine {
            data,
            at: 0,
            stack: Vec::new(),
            marks: Vec::new(),
            memo: HashMap::new(),
            budget: data.len() + 16,
            made: 0,
            stored: 0,
            decoded: 0,
        }
    }

    /// Runs opcode `op` (not STOP).
    fn step(&mut self, op: u8) -> Result<(), String> {
        match op {
            0x80 => {
                self.take(1)?; // PROTO
            }
            0x95 => {
                self.take(8)?; // FRAME: a length hint only
            }
            b'C' | b'U' | b'B' | b'T' | 0x8e | 0x96 | b'S' | 0x8c | b'X' | 0x8d | b'V' => {
                self.text_or_bytes(op)?;
            }
            b'K' | b'M' | b'J' | b'I' | b'L' | 0x8a | 0x8b | b'F' | b'G' | b'N' | 0x88 | 0x89 => {
                self.number_or_constant(op)?;
            }
            b'}'
            | 0x8f
            | b')'
            | b']'
            | 0x85..=0x87
            | b'('
            | b't'
            | b'l'
            | b'e'
            | b'a'
            | b'u'
            | 0x90
            | 0x91
            | b's'
            | b'0'
            | b'1'
            | b'2' => self.container_or_stack(op)?,
            b'c' | 0x93 | b'R' | b'b' => self.global_or_call(op)?,
            0x94 | b'q' | b'r' | b'p' | b'h' | b'j' | b'g' => self.memo_op(op)?,
            0x81 | 0x92 | b'i' | b'o' => {
                return Err(format!(
                    "the pickle makes an object of a class (opcode 0x{op:02x}); {CONVERT}"
                ));
            }
            0x97 | 0x98 => {
                return Err(
                    "the pickle refers to an out-of-band buffer, which a stored pickle cannot hold"
                        .into(),
                );
            }
            other => {
                return Err(format!(
                    "unsupported pickle opcode 0x{other:02x} at byte {}; {CONVERT}",
                    self.at - 1
                ));
            }
        }
        Ok(())
    }

    /// The next `n` bytes' range.
    fn take(&mut self, n: usize) -> Result<Range<usize>, String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or("pickle is truncated")?;
        let r = self.at..end;
        self.at = end;
        Ok(r)
    }

    /// A protocol-0 argument: the bytes up to the next newline (which is consumed).
    fn line(&mut self) -> Result<Range<usize>, String> {
        let rest = self.data.get(self.at..).ok_or("pickle is truncated")?;
        let len = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or("pickle is truncated (a line without its newline)")?;
        let r = self.at..self.at + len;
        self.at += len + 1;
        Ok(r)
    }

    /// The next `n` bytes as a little-endian unsigned integer.
    fn uint(&mut self, n: usize) -> Result<u64, String> {
        let r = self.take(n)?;
        Ok(self.data[r]
            .iter()
            .rev()
            .fold(0u64, |v, &b| (v << 8) | b as u64))
    }

    fn utf8(&self, r: Range<usize>) -> Result<Rc<str>, String> {
        std::str::from_utf8(&self.data[r])
            .map(Rc::from)
            .map_err(|_| "a str that is not UTF-8".to_string())
    }

    /// Pushes `item`, which cost `cost` values: every value made costs one; a memo GET copies,
    /// and costs what it copies.
    fn push(&mut self, item: Item, cost: usize) -> Result<(), String> {
        self.made = self.made.saturating_add(cost);
        if self.made > self.budget {
            return Err(format!(
                "pickle of {} bytes expands to more than {} values (repeated memo references)",
                self.data.len(),
                self.budget
            ));
        }
        self.stack.push(item);
        Ok(())
    }

    fn push_leaf(&mut self, value: Value) -> Result<(), String> {
        self.push(Item::leaf(value), 1)
    }

    fn pop(&mut self, what: &str) -> Result<Item, String> {
        self.stack
            .pop()
            .ok_or_else(|| format!("{what} on an empty stack"))
    }

    /// Bytes and text: SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8 and Python 2's
    /// SHORT_BINSTRING, BINSTRING and STRING (its `str` is bytes); SHORT_BINUNICODE,
    /// BINUNICODE, BINUNICODE8 (UTF-8) and UNICODE (raw-unicode-escape).
    fn text_or_bytes(&mut self, op: u8) -> Result<(), String> {
        let value = match op {
            b'C' | b'U' => {
                let n = self.uint(1)? as usize;
                Value::Bytes(self.take(n)?)
            }
            b'B' | b'T' => {
                let n = self.uint(4)? as usize;
                Value::Bytes(self.take(n)?)
            }
            0x8e | 0x96 => {
                let n = usize::try_from(self.uint(8)?).map_err(|_| "absurd bytes length")?;
                Value::Bytes(self.take(n)?)
            }
            // A quoted, escaped repr on one line.
            b'S' => {
                let r = self.line()?;
                Value::OwnedBytes(unquote_escaped(&self.data[r])?.into())
            }
            0x8c => {
                let n = self.uint(1)? as usize;
                let r = self.take(n)?;
                Value::Str(self.utf8(r)?)
            }
            b'X' => {
                let n = self.uint(4)? as usize;
                let r = self.take(n)?;
                Value::Str(self.utf8(r)?)
            }
            0x8d => {
                let n = usize::try_from(self.uint(8)?).map_err(|_| "absurd str length")?;
                let r = self.take(n)?;
                Value::Str(self.utf8(r)?)
            }
            _ => {
                let r = self.line()?;
                Value::Str(raw_unicode_escape(&self.data[r])?.into())
            }
        };
        self.push_leaf(value)
    }

    /// Integers (BININT1, BININT2, BININT, INT, LONG, LONG1, LONG4), floats (FLOAT, BINFLOAT:
    /// never a label here, but allowed beside one), None, True and False.
    fn number_or_constant(&mut self, op: u8) -> Result<(), String> {
        let value = match op {
            b'K' => Value::Int(self.uint(1)? as i64),
            b'M' => Value::Int(self.uint(2)? as i64),
            b'J' => Value::Int(self.uint(4)? as u32 as i32 as i64),
            // INT and LONG as decimal text (protocol 0); `I00`/`I01` are False/True.
            b'I' | b'L' => {
                let r = self.line()?;
                let text =
                    std::str::from_utf8(&self.data[r]).map_err(|_| "an INT that is not text")?;
                match (op, text) {
                    (b'I', "00" | "01") => Value::Other(OtherKind::Bool),
                    _ => Value::Int(
                        text.strip_suffix('L')
                            .unwrap_or(text)
                            .parse::<i64>()
                            .map_err(|_| format!("integer {text:?} is not within 64 bits"))?,
                    ),
                }
            }
            // LONG1 / LONG4: n bytes, little-endian two's complement.
            0x8a | 0x8b => {
                let n = self.uint(if op == 0x8a { 1 } else { 4 })? as usize;
                if n > 8 {
                    return Err("integer wider than 64 bits".into());
                }
                let mut v = self.uint(n)? as i64;
                if n > 0 && n < 8 && self.data[self.at - 1] & 0x80 != 0 {
                    v -= 1i64 << (8 * n);
                }
                Value::Int(v)
            }
            b'F' => {
                self.line()?;
                Value::Other(OtherKind::Float)
            }
            b'G' => {
                self.take(8)?;
                Value::Other(OtherKind::Float)
            }
            b'N' => Value::Other(OtherKind::None),
            0x88 | 0x89 => Value::Other(OtherKind::Bool), // NEWTRUE, NEWFALSE
            other => return Err(format!("opcode {other:#04x} is no number or constant")),
        };
        self.push_leaf(value)
    }

    /// Tuples and lists (made and filled), opaque dicts, sets and frozensets (whose items are
    /// dropped), and the stack's own opcodes (MARK, POP, POP_MARK, DUP).
    fn container_or_stack(&mut self, op: u8) -> Result<(), String> {
        match op {
            // EMPTY_DICT, EMPTY_SET: opaque; SETITEM(S)/ADDITEMS below fill nothing in.
            b'}' => self.push_leaf(Value::Other(OtherKind::Dict))?,
            0x8f => self.push_leaf(Value::Other(OtherKind::Set))?,
            b')' => self.push(Item::container(Vec::new(), false)?, 1)?,
            b']' => self.push(Item::container(Vec::new(), true)?, 1)?,
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                let len = self.stack.len();
                if len < n {
                    return Err("tuple needs more items than the stack holds".into());
                }
                let items = self.stack.split_off(len - n);
                self.push(Item::container(items, false)?, 1)?;
            }
            b'(' => self.marks.push(self.stack.len()),
            b't' | b'l' => {
                let list = op == b'l';
                let what = if list { "LIST" } else { "TUPLE" };
                let items = items_since_mark(&mut self.stack, &mut self.marks, what)?;
                self.push(Item::container(items, list)?, 1)?;
            }
            b'e' => {
                let items = items_since_mark(&mut self.stack, &mut self.marks, "APPENDS")?;
                self.stack
                    .last_mut()
                    .ok_or("APPENDS onto an empty stack")?
                    .extend(items)?;
            }
            b'a' => {
                let item = self.pop("APPEND")?;
                self.stack
                    .last_mut()
                    .ok_or("APPEND onto an empty stack")?
                    .extend(vec![item])?;
            }
            b'u' | 0x90 | b's' => {
                // SETITEMS / ADDITEMS / SETITEM into an opaque dict or set: dropped.
                if op == b's' {
                    self.pop("SETITEM")?;
                    self.pop("SETITEM")?;
                } else {
                    items_since_mark(&mut self.stack, &mut self.marks, "SETITEMS")?;
                }
                // SETITEM(S) fill a dict, ADDITEMS a set.
                let (target, what) = match op {
                    0x90 => (OtherKind::Set, "ADDITEMS onto something that is not a set"),
                    b's' => (OtherKind::Dict, "SETITEM onto something that is not a dict"),
                    _ => (
                        OtherKind::Dict,
                        "SETITEMS onto something that is not a dict",
                    ),
                };
                if self.stack.last().map(|i| &i.value) != Some(&Value::Other(target)) {
                    return Err(what.into());
                }
            }
            0x91 => {
                // FROZENSET: the items since the mark, dropped.
                items_since_mark(&mut self.stack, &mut self.marks, "FROZENSET")?;
                self.push_leaf(Value::Other(OtherKind::FrozenSet))?;
            }
            b'0' => {
                self.pop("POP")?;
            }
            b'1' => {
                items_since_mark(&mut self.stack, &mut self.marks, "POP_MARK")?;
            }
            _ => {
                // DUP
                let top = self.stack.last().cloned().ok_or("DUP on an empty stack")?;
                let cost = top.nodes;
                self.push(top, cost)?;
            }
        }
        Ok(())
    }

    /// GLOBAL (module and name on two lines), STACK_GLOBAL (two str on the stack), REDUCE (the
    /// calls [`call`] allows) and BUILD.
    fn global_or_call(&mut self, op: u8) -> Result<(), String> {
        match op {
            b'c' => {
                let r = self.line()?;
                let module = self.utf8(r)?;
                let r = self.line()?;
                let name = self.utf8(r)?;
                self.push_leaf(Value::Global(module, name))
            }
            0x93 => {
                let name = self.pop("STACK_GLOBAL")?.value;
                let module = self.pop("STACK_GLOBAL")?.value;
                let (Value::Str(module), Value::Str(name)) = (module, name) else {
                    return Err("STACK_GLOBAL of something that is not two str".into());
                };
                self.push_leaf(Value::Global(module, name))
            }
            b'R' => {
                let args = self.pop("REDUCE")?.value;
                let callable = self.pop("REDUCE")?.value;
                let result = call(callable, args, self.data)?;
                // A call makes new bytes (encode decodes a text): a shared text can be
                // referenced for free, so what calls make is bounded by the input on its own.
                if let Value::OwnedBytes(bytes) = &result {
                    self.decoded = self.decoded.saturating_add(bytes.len());
                    if self.decoded > self.budget {
                        return Err(format!(
                            "pickle of {} bytes decodes more than {} bytes (repeated calls \
                             on memo references)",
                            self.data.len(),
                            self.budget
                        ));
                    }
                }
                self.push_leaf(result)
            }
            _ => {
                // BUILD
                let state = self.pop("BUILD")?.value;
                let target = self.stack.last_mut().ok_or("BUILD on an empty stack")?;
                build(&mut target.value, state)
            }
        }
    }

    /// The memo: MEMOIZE, PUT (BINPUT, LONG_BINPUT, PUT) and GET (BINGET, LONG_BINGET, GET).
    fn memo_op(&mut self, op: u8) -> Result<(), String> {
        let index = match op {
            0x94 => None,
            b'q' | b'h' => Some(self.uint(1)?),
            b'r' | b'j' => Some(self.uint(4)?),
            _ => {
                let r = self.line()?;
                Some(decimal(&self.data[r])?)
            }
        };
        let index = match index {
            // MEMOIZE: memo[len(memo)] = top
            None => u32::try_from(self.memo.len()).map_err(|_| "too many memo entries")?,
            Some(i) => u32::try_from(i).map_err(|_| "memo index beyond 2^32")?,
        };
        if matches!(op, b'h' | b'j' | b'g') {
            let value = self
                .memo
                .get(&index)
                .ok_or("GET of an unknown memo entry")?;
            // Every memo entry was made within the budget, so one copy is bounded too.
            let (value, cost) = (value.clone(), value.nodes);
            return self.push(value, cost);
        }
        let what = if op == 0x94 { "MEMOIZE" } else { "PUT" };
        let top = self
            .stack
            .last()
            .ok_or_else(|| format!("{what} on an empty stack"))?;
        // A memo store copies the top of the stack: it costs its values.
        self.stored = self.stored.saturating_add(top.nodes);
        if self.stored > 4 * self.budget {
            return Err(format!(
                "pickle of {} bytes stores more than {} values in its memo (repeated PUT or \
                 MEMOIZE)",
                self.data.len(),
                4 * self.budget
            ));
        }
        let top = top.clone();
        self.memo.insert(index, top);
        Ok(())
    }
}

/// A decimal memo index (protocol 0's PUT and GET).
fn decimal(text: &[u8]) -> Result<u64, String> {
    std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.parse::<u64>().ok())
        .ok_or_else(|| "a memo index that is not a number".into())
}

/// Evaluates the calls folder2lmdb pickles make (see the module docs); any other is an error.
fn call(callable: Value, args: Value, data: &[u8]) -> Result<Value, String> {
    let Value::Global(module, name) = callable else {
        return Err("REDUCE of something that is not a global".into());
    };
    let Value::Tuple(args) = args else {
        return Err(format!(
            "{module}.{name} called with arguments that are not a tuple"
        ));
    };
    match (&*module, &*name, args.as_slice()) {
        // How protocols 0 to 2 store bytes: encode(text, "latin1") gives back the byte values.
        ("_codecs", "encode", [Value::Str(text), Value::Str(encoding)])
            if matches!(&**encoding, "latin1" | "latin-1" | "iso-8859-1") =>
        {
            text.chars()
                .map(|c| u8::try_from(u32::from(c)).ok())
                .collect::<Option<Rc<[u8]>>>()
                .map(Value::OwnedBytes)
                .ok_or_else(|| "a latin-1 encoded str holds a character beyond U+00FF".into())
        }
        ("__builtin__" | "builtins", "bytes" | "bytearray", []) => {
            Ok(Value::OwnedBytes(Rc::from(&[][..])))
        }
        ("numpy", "dtype", [Value::Str(descr), ..]) => int_dtype(descr).ok_or_else(|| {
            format!("a NumPy value of dtype {descr:?}; only integer labels are read")
        }),
        ("numpy.core.multiarray" | "numpy._core.multiarray", "scalar", [dtype, raw])
            if matches!(dtype, Value::IntDtype { .. }) =>
        {
            let Value::IntDtype {
                signed,
                size,
                little,
            } = dtype
            else {
                unreachable!("matched above")
            };
            let bytes = raw
                .bytes(data)
                .ok_or("a NumPy scalar whose value is not bytes")?;
            if bytes.len() != *size {
                return Err(format!(
                    "a NumPy scalar of {size} bytes holds {} bytes",
                    bytes.len()
                ));
            }
            let mut value = 0u64;
            for i in 0..*size {
                let byte = if *little {
                    bytes[*size - 1 - i]
                } else {
                    bytes[i]
                };
                value = (value << 8) | u64::from(byte);
            }
            let value = if *signed && *size < 8 && value >> (8 * size - 1) & 1 == 1 {
                value as i64 - (1i64 << (8 * size))
            } else if *signed {
                value as i64
            } else {
                i64::try_from(value).map_err(|_| "a uint64 label beyond 2^63")?
            };
            Ok(Value::Int(value))
        }
        _ => Err(format!("the pickle calls {module}.{name}; {CONVERT}")),
    }
}

/// A NumPy integer dtype from its descriptor (`i8`, `<u2`, `int64`, ...).
fn int_dtype(descr: &str) -> Option<Value> {
    let (little, rest) = match descr.as_bytes().first() {
        Some(b'>') => (false, &descr[1..]),
        Some(b'<' | b'|' | b'=') => (true, &descr[1..]),
        _ => (true, descr),
    };
    let (signed, size) = match rest {
        "i1" | "int8" | "b" => (true, 1),
        "i2" | "int16" | "h" => (true, 2),
        "i4" | "int32" | "l" | "i" => (true, 4),
        "i8" | "int64" | "q" => (true, 8),
        "u1" | "uint8" | "B" => (false, 1),
        "u2" | "uint16" | "H" => (false, 2),
        "u4" | "uint32" | "I" => (false, 4),
        "u8" | "uint64" | "Q" => (false, 8),
        _ => return None,
    };
    Some(Value::IntDtype {
        signed,
        size,
        little,
    })
}

/// BUILD: the state NumPy pickles a dtype with, `(3, byteorder, ...)`, sets its byte order.
fn build(target: &mut Value, state: Value) -> Result<(), String> {
    match (target, state) {
        (Value::IntDtype { little, .. }, Value::Tuple(state)) => {
            match state.get(1) {
                Some(Value::Str(order)) if &**order == ">" => *little = false,
                Some(Value::Str(order)) if matches!(&**order, "<" | "|" | "=") => *little = true,
                _ => return Err("a NumPy dtype with an unknown byte order".into()),
            }
            Ok(())
        }
        _ => Err(format!("the pickle sets the state of an object; {CONVERT}")),
    }
}

/// Python 2's STRING argument: `'...'` or `"..."` with the escapes of a Python 2 `repr`
/// (`\\`, `\'`, `\"`, `\n`, `\r`, `\t`, `\a`, `\b`, `\f`, `\v`, `\xHH`, octal `\ooo`).
fn unquote_escaped(text: &[u8]) -> Result<Vec<u8>, String> {
    let inner = match text {
        [b'\'', inner @ .., b'\''] | [b'"', inner @ .., b'"'] => inner,
        _ => return Err("a STRING that is not quoted".into()),
    };
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter().copied();
    while let Some(b) = bytes.next() {
        if b != b'\\' {
            out.push(b);
            continue;
        }
        let escaped = bytes.next().ok_or("a STRING that ends in a backslash")?;
        match escaped {
            b'\\' | b'\'' | b'"' => out.push(escaped),
            b'n' => out.push(b'\n'),
            b'r' => out.push(b'\r'),
            b't' => out.push(b'\t'),
            b'a' => out.push(0x07),
            b'b' => out.push(0x08),
            b'f' => out.push(0x0c),
            b'v' => out.push(0x0b),
            b'\n' => {}
            b'x' => {
                let hex = [bytes.next(), bytes.next()];
                let [Some(h), Some(l)] = hex else {
                    return Err("a STRING with a short \\x escape".into());
                };
                let digit = |c: u8| (c as char).to_digit(16);
                match (digit(h), digit(l)) {
                    (Some(h), Some(l)) => out.push((h * 16 + l) as u8),
                    _ => return Err("a STRING with a bad \\x escape".into()),
                }
            }
            b'0'..=b'7' => {
                let mut value = u32::from(escaped - b'0');
                let mut rest = bytes.clone();
                for _ in 0..2 {
                    match rest.next() {
                        Some(d @ b'0'..=b'7') => {
                            value = value * 8 + u32::from(d - b'0');
                            bytes.next();
                        }
                        _ => break,
                    }
                    rest = bytes.clone();
                }
                out.push(value as u8);
            }
            other => {
                out.push(b'\\');
                out.push(other);
            }
        }
    }
    Ok(out)
}

/// The UNICODE argument of protocol 0: latin-1 bytes with `\uXXXX` and `\UXXXXXXXX` escapes.
fn raw_unicode_escape(text: &[u8]) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    while at < text.len() {
        let b = text[at];
        let width = match (b, text.get(at + 1)) {
            (b'\\', Some(b'u')) => 4,
            (b'\\', Some(b'U')) => 8,
            _ => {
                out.push(char::from(b));
                at += 1;
                continue;
            }
        };
        let digits = text
            .get(at + 2..at + 2 + width)
            .and_then(|d| std::str::from_utf8(d).ok())
            .and_then(|d| u32::from_str_radix(d, 16).ok())
            .and_then(char::from_u32)
            .ok_or("a UNICODE with a bad \\u escape")?;
        out.push(digits);
        at += 2 + width;
    }
    Ok(out)
}

/// Where a folder2lmdb value's image is: in the input, or decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Image {
    /// A range of the value (zero-copy).
    Stored(Range<usize>),
    /// Bytes decoded from a text form.
    Decoded(Vec<u8>),
}

/// Splits a folder2lmdb value, `(image_bytes, label)`, into the image and the label.
pub fn image_and_label(data: &[u8]) -> Result<(Image, i64), String> {
    image_label_and_items(data).map(|(image, label, _)| (image, label))
}

/// [`image_and_label`], and how many items the tuple holds: more than two where a writer
/// stored more beside them (`(image, coarse, fine)`), of which folder2lmdb's loader reads the
/// first two as these do.
pub fn image_label_and_items(data: &[u8]) -> Result<(Image, i64, usize), String> {
    let looks_pickled = matches!(data.first(), Some(0x80 | b'(' | b'c' | b'S' | b'U' | b'T'));
    if !looks_pickled {
        return Err(if data.is_empty() {
            "empty value".into()
        } else {
            "value is not a pickle (pyarrow.serialize'd values, from before pyarrow 12, are not supported)".into()
        });
    }
    let expected = "expected a pickled (bytes, label) tuple";
    // What was found instead is named (a hostile try met only the generic message).
    match parse(data)? {
        // A list reads as folder2lmdb's loader reads it (`value[0]`, `value[1]`): as a tuple.
        Value::Tuple(items) | Value::List(items) => match items.as_slice() {
            [image, Value::Int(label), ..] => match image {
                Value::Bytes(r) => Ok((Image::Stored(r.clone()), *label, items.len())),
                Value::OwnedBytes(b) => Ok((Image::Decoded(b.to_vec()), *label, items.len())),
                other => Err(format!("{expected}; its image is {}", other.kind())),
            },
            [_, label, ..] => Err(format!(
                "{expected}; its label is {}, not an integer (a class index)",
                label.kind()
            )),
            short => Err(format!(
                "{expected}; found a tuple or list of {}",
                short.len()
            )),
        },
        other => Err(format!("{expected}; found {}", other.kind())),
    }
}

impl Value {
    /// What kind of Python value this is, for messages.
    fn kind(&self) -> &'static str {
        match self {
            Value::Bytes(_) | Value::OwnedBytes(_) => "bytes",
            Value::Str(_) => "a str",
            Value::Int(_) => "an int",
            Value::Tuple(_) => "a tuple",
            Value::List(_) => "a list",
            Value::Global(..) => "a class or function",
            Value::IntDtype { .. } => "a NumPy dtype",
            Value::Other(OtherKind::None) => "None",
            Value::Other(OtherKind::Bool) => "a bool",
            Value::Other(OtherKind::Float) => "a float",
            Value::Other(OtherKind::Dict) => "a dict",
            Value::Other(OtherKind::Set) => "a set",
            Value::Other(OtherKind::FrozenSet) => "a frozenset",
        }
    }
}

#[cfg(test)]
mod tests;
