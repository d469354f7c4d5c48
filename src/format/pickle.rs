//! A minimal, strict reader for the few pickles the Python folder2lmdb scripts store:
//! `(image_bytes, label)` tuples, an `int` (`__len__`), and a list of `bytes` keys
//! (`__keys__`), as written by `pickle.dumps` with protocols 2 to 5.
//!
//! It interprets only the opcodes those objects need (no globals, no reduce: nothing can run)
//! and fails with a description of the first unsupported opcode. Byte strings are returned as
//! ranges into the input, so reading an image is still zero-copy.

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

/// Decodes one pickle.
pub fn parse(data: &[u8]) -> Result<Value, String> {
    let mut stack: Vec<Value> = Vec::new();
    let mut marks: Vec<usize> = Vec::new();
    let mut memo: Vec<Value> = Vec::new();
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
        match op {
            0x80 => {
                take(&mut at, 1)?; // PROTO
            }
            0x95 => {
                take(&mut at, 8)?; // FRAME: a length hint only
            }
            b'C' => {
                let n = uint(take(&mut at, 1)?) as usize;
                stack.push(Value::Bytes(take(&mut at, n)?));
            }
            b'B' => {
                let n = uint(take(&mut at, 4)?) as usize;
                stack.push(Value::Bytes(take(&mut at, n)?));
            }
            0x8e => {
                let n =
                    usize::try_from(uint(take(&mut at, 8)?)).map_err(|_| "absurd bytes length")?;
                stack.push(Value::Bytes(take(&mut at, n)?));
            }
            b'K' => stack.push(Value::Int(uint(take(&mut at, 1)?) as i64)),
            b'M' => stack.push(Value::Int(uint(take(&mut at, 2)?) as i64)),
            b'J' => stack.push(Value::Int(uint(take(&mut at, 4)?) as u32 as i32 as i64)),
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
                stack.push(Value::Int(v));
            }
            b'N' | 0x88 | 0x89 => stack.push(Value::Other),
            b')' => stack.push(Value::Tuple(Vec::new())),
            b']' => stack.push(Value::List(Vec::new())),
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                let len = stack.len();
                if len < n {
                    return Err("tuple needs more items than the stack holds".into());
                }
                let items = stack.split_off(len - n);
                stack.push(Value::Tuple(items));
            }
            b'(' => marks.push(stack.len()),
            b't' => {
                let mark = marks.pop().ok_or("TUPLE without MARK")?;
                let items = stack.split_off(mark);
                stack.push(Value::Tuple(items));
            }
            b'e' => {
                let mark = marks.pop().ok_or("APPENDS without MARK")?;
                let items = stack.split_off(mark);
                match stack.last_mut() {
                    Some(Value::List(list)) => list.extend(items),
                    _ => return Err("APPENDS onto something that is not a list".into()),
                }
            }
            b'a' => {
                let item = stack.pop().ok_or("APPEND on an empty stack")?;
                match stack.last_mut() {
                    Some(Value::List(list)) => list.push(item),
                    _ => return Err("APPEND onto something that is not a list".into()),
                }
            }
            0x94 => memo.push(stack.last().cloned().ok_or("MEMOIZE on an empty stack")?),
            b'q' | b'r' => {
                // BINPUT / LONG_BINPUT: memo[i] = top
                let i = uint(take(&mut at, if op == b'q' { 1 } else { 4 })?) as usize;
                let top = stack.last().cloned().ok_or("PUT on an empty stack")?;
                if memo.len() <= i {
                    memo.resize(i + 1, Value::Other);
                }
                memo[i] = top;
            }
            b'h' | b'j' => {
                let i = uint(take(&mut at, if op == b'h' { 1 } else { 4 })?) as usize;
                stack.push(memo.get(i).cloned().ok_or("GET of an unknown memo entry")?);
            }
            b'.' => return stack.pop().ok_or_else(|| "STOP on an empty stack".into()),
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
    }
}
