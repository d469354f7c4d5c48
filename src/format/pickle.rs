//! A minimal, strict reader for the few pickles the Python folder2lmdb scripts store:
//! `(image_bytes, label)` tuples, an `int` (`__len__`), and a list of `bytes` keys
//! (`__keys__`), as written by `pickle.dumps` with protocols 2 to 5.
//!
//! It interprets only the opcodes those objects need (no globals, no reduce: nothing can run)
//! and fails with a description of the first unsupported opcode. Byte strings are returned as
//! ranges into the input, so reading an image is still zero-copy.

use std::collections::HashMap;
use std::ops::Range;

/// A decoded value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// `bytes`: a range of the input.
    Bytes(Range<usize>),
    /// `int` (within i64).
    Int(i64),
    /// `tuple`.
    Tuple(Vec<Value>),
    /// `list`.
    List(Vec<Value>),
    /// `None`, `True`, `False` (as they may appear in forks' extra fields).
    Other,
}

/// The deepest nesting of tuples and lists accepted (folder2lmdb pickles nest two deep).
const MAX_DEPTH: u32 = 32;

/// A value on the unpickler's stack, with what bounds it: how deeply it nests, and how many
/// values it holds in all (itself included).
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

/// Decodes one pickle.
///
/// Everything the input can ask for is bounded by the input itself: a value is at most as big as
/// the bytes that describe it, memo references (`GET`, which copies here, where Python would
/// share) may not make the values outnumber the input's bytes, memo indices are only keys of a
/// map (a `LONG_BINPUT` of 2³² − 1 allocates nothing), and nesting stops at [`MAX_DEPTH`].
pub fn parse(data: &[u8]) -> Result<Value, String> {
    let mut stack: Vec<Item> = Vec::new();
    let mut marks: Vec<usize> = Vec::new();
    let mut memo: HashMap<u32, Item> = HashMap::new();
    // Values made so far, clones included: never more than one per input byte (plus slack).
    let budget = data.len() + 16;
    let mut made = 0usize;
    let mut at = 0usize;
    let take = |at: &mut usize, n: usize| -> Result<Range<usize>, String> {
        let end = at
            .checked_add(n)
            .filter(|&e| e <= data.len())
            .ok_or("pickle is truncated")?;
        let r = *at..end;
        *at = end;
        Ok(r)
    };
    let uint = |r: Range<usize>| data[r].iter().rev().fold(0u64, |v, &b| (v << 8) | b as u64);
    loop {
        let op = *data.get(at).ok_or("pickle ends without STOP")?;
        at += 1;
        // Every value made costs one; a memo GET copies, and costs what it copies.
        let mut push = |stack: &mut Vec<Item>, item: Item, cost: usize| -> Result<(), String> {
            made = made.saturating_add(cost);
            if made > budget {
                return Err(format!(
                    "pickle of {} bytes expands to more than {budget} values (repeated memo references)",
                    data.len()
                ));
            }
            stack.push(item);
            Ok(())
        };
        match op {
            0x80 => {
                take(&mut at, 1)?; // PROTO
            }
            0x95 => {
                take(&mut at, 8)?; // FRAME: a length hint only
            }
            b'C' => {
                let n = uint(take(&mut at, 1)?) as usize;
                push(&mut stack, Item::leaf(Value::Bytes(take(&mut at, n)?)), 1)?;
            }
            b'B' => {
                let n = uint(take(&mut at, 4)?) as usize;
                push(&mut stack, Item::leaf(Value::Bytes(take(&mut at, n)?)), 1)?;
            }
            0x8e => {
                let n =
                    usize::try_from(uint(take(&mut at, 8)?)).map_err(|_| "absurd bytes length")?;
                push(&mut stack, Item::leaf(Value::Bytes(take(&mut at, n)?)), 1)?;
            }
            b'K' => push(
                &mut stack,
                Item::leaf(Value::Int(uint(take(&mut at, 1)?) as i64)),
                1,
            )?,
            b'M' => push(
                &mut stack,
                Item::leaf(Value::Int(uint(take(&mut at, 2)?) as i64)),
                1,
            )?,
            b'J' => push(
                &mut stack,
                Item::leaf(Value::Int(uint(take(&mut at, 4)?) as u32 as i32 as i64)),
                1,
            )?,
            0x8a => {
                // LONG1: n bytes, little-endian two's complement.
                let n = uint(take(&mut at, 1)?) as usize;
                if n > 8 {
                    return Err("integer wider than 64 bits".into());
                }
                let r = take(&mut at, n)?;
                let mut v = uint(r) as i64;
                if n > 0 && n < 8 && data[at - 1] & 0x80 != 0 {
                    v -= 1i64 << (8 * n);
                }
                push(&mut stack, Item::leaf(Value::Int(v)), 1)?;
            }
            b'N' | 0x88 | 0x89 => push(&mut stack, Item::leaf(Value::Other), 1)?,
            b')' => push(&mut stack, Item::container(Vec::new(), false)?, 1)?,
            b']' => push(&mut stack, Item::container(Vec::new(), true)?, 1)?,
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                let len = stack.len();
                if len < n {
                    return Err("tuple needs more items than the stack holds".into());
                }
                let items = stack.split_off(len - n);
                push(&mut stack, Item::container(items, false)?, 1)?;
            }
            b'(' => marks.push(stack.len()),
            b't' => {
                let items = items_since_mark(&mut stack, &mut marks, "TUPLE")?;
                push(&mut stack, Item::container(items, false)?, 1)?;
            }
            b'e' => {
                let items = items_since_mark(&mut stack, &mut marks, "APPENDS")?;
                stack
                    .last_mut()
                    .ok_or("APPENDS onto an empty stack")?
                    .extend(items)?;
            }
            b'a' => {
                let item = stack.pop().ok_or("APPEND on an empty stack")?;
                stack
                    .last_mut()
                    .ok_or("APPEND onto an empty stack")?
                    .extend(vec![item])?;
            }
            0x94 => {
                // MEMOIZE: memo[len(memo)] = top
                let top = stack.last().cloned().ok_or("MEMOIZE on an empty stack")?;
                let index = u32::try_from(memo.len()).map_err(|_| "too many memo entries")?;
                memo.insert(index, top);
            }
            b'q' | b'r' => {
                // BINPUT / LONG_BINPUT: memo[i] = top
                let i = uint(take(&mut at, if op == b'q' { 1 } else { 4 })?) as u32;
                let top = stack.last().cloned().ok_or("PUT on an empty stack")?;
                memo.insert(i, top);
            }
            b'h' | b'j' => {
                let i = uint(take(&mut at, if op == b'h' { 1 } else { 4 })?) as u32;
                let value = memo.get(&i).ok_or("GET of an unknown memo entry")?;
                // Every memo entry was made within the budget, so one copy is bounded too.
                let (value, cost) = (value.clone(), value.nodes);
                push(&mut stack, value, cost)?;
            }
            b'.' => {
                return stack
                    .pop()
                    .map(|item| item.value)
                    .ok_or_else(|| "STOP on an empty stack".into());
            }
            other => {
                return Err(format!(
                    "unsupported pickle opcode 0x{other:02x} at byte {} (only bytes, ints, tuples and lists are read)",
                    at - 1
                ));
            }
        }
    }
}

/// Splits a folder2lmdb value, `(image_bytes, label)`, into the image's range and the label.
pub fn image_and_label(data: &[u8]) -> Result<(Range<usize>, i64), String> {
    if data.first() != Some(&0x80) {
        return Err(if data.is_empty() {
            "empty value".into()
        } else {
            "value is not a pickle (pyarrow.serialize'd values, from before pyarrow 12, are not supported)".into()
        });
    }
    match parse(data)? {
        Value::Tuple(items) => match items.as_slice() {
            [Value::Bytes(image), Value::Int(label), ..] => Ok((image.clone(), *label)),
            _ => Err("expected a pickled (bytes, int) tuple".into()),
        },
        _ => Err("expected a pickled (bytes, int) tuple".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_4_tuple_of_bytes_and_int() {
        // pickle.dumps((b'\xff\xd8ab', 7), protocol=4)
        let data = b"\x80\x04\x95\x0c\x00\x00\x00\x00\x00\x00\x00C\x04\xff\xd8ab\x94K\x07\x86\x94.";
        let (image, label) = image_and_label(data).unwrap();
        assert_eq!((&data[image], label), (&b"\xff\xd8ab"[..], 7));
    }

    #[test]
    fn larger_ints_and_lists() {
        // pickle.dumps([b'0', b'1', b'10'], protocol=4)
        let data =
            b"\x80\x04\x95\x12\x00\x00\x00\x00\x00\x00\x00]\x94(C\x010\x94C\x011\x94C\x0210\x94e.";
        match parse(data).unwrap() {
            Value::List(items) => {
                let keys: Vec<&[u8]> = items
                    .iter()
                    .map(|v| match v {
                        Value::Bytes(r) => &data[r.clone()],
                        _ => panic!(),
                    })
                    .collect();
                assert_eq!(keys, [&b"0"[..], b"1", b"10"]);
            }
            other => panic!("{other:?}"),
        }
        // pickle.dumps(1281167, protocol=2) -> BININT
        assert_eq!(
            parse(b"\x80\x02J\x8f\x8c\x13\x00.").unwrap(),
            Value::Int(1_281_167)
        );
        // pickle.dumps(-1, protocol=2) -> BININT
        assert_eq!(
            parse(b"\x80\x02J\xff\xff\xff\xff.").unwrap(),
            Value::Int(-1)
        );
        // pickle.dumps(2**40, protocol=2) -> LONG1 with 6 bytes
        assert_eq!(
            parse(b"\x80\x02\x8a\x06\x00\x00\x00\x00\x00\x01.").unwrap(),
            Value::Int(1 << 40)
        );
    }

    #[test]
    fn hostile_or_foreign_input_is_an_error_not_a_panic() {
        assert!(image_and_label(b"").unwrap_err().contains("empty"));
        assert!(image_and_label(b"ARROW1").unwrap_err().contains("pyarrow"));
        assert!(parse(b"\x80\x04C\xff").unwrap_err().contains("truncated"));
        assert!(parse(b"\x80\x04\x8e\xff\xff\xff\xff\xff\xff\xff\xff").is_err());
        assert!(
            parse(b"\x80\x04cos\nsystem\n.")
                .unwrap_err()
                .contains("unsupported pickle opcode 0x63")
        );
        assert!(parse(b"\x80\x04e.").unwrap_err().contains("MARK"));
        // Found by fuzzing: a MARK left above the stack's top by TUPLE2 panicked in split_off.
        for op in [b't', b'e'] {
            let pickle = [b"\x80\x02K\x01K\x02(\x86".as_slice(), &[op, b'.']].concat();
            assert!(parse(&pickle).unwrap_err().contains("above the stack"));
        }
    }

    #[test]
    fn a_memo_index_near_two_to_the_32_allocates_nothing() {
        // Regression: LONG_BINPUT 0xFFFFFFF0 resized the memo to 2^32 entries (~137 GB).
        let data = b"\x80\x04K\x07r\xf0\xff\xff\xffj\xf0\xff\xff\xff\x86.";
        assert_eq!(
            parse(data).unwrap(),
            Value::Tuple(vec![Value::Int(7), Value::Int(7)])
        );
    }

    #[test]
    fn memo_references_cannot_expand_a_pickle_beyond_its_size() {
        // A list, then 40 rounds of "a tuple of two copies of the last value": 2^40 values
        // from ~300 bytes, as a pickle bomb does.
        let mut data = b"\x80\x04]q\x00".to_vec();
        for i in 0..40u8 {
            data.extend_from_slice(&[b'h', i, b'h', i, 0x86, b'q', i + 1]);
        }
        data.push(b'.');
        let err = parse(&data).unwrap_err();
        assert!(err.contains("expands to more than"), "{err}");
        // Nesting is bounded too (each level is one MARK ... TUPLE).
        let mut deep = b"\x80\x04".to_vec();
        deep.extend(std::iter::repeat_n(b'(', 10_000));
        deep.extend(std::iter::repeat_n(b't', 10_000));
        deep.push(b'.');
        assert!(parse(&deep).unwrap_err().contains("nested deeper"));
    }
}
