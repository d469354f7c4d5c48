//! The protobuf wire format of `tf.train.Example`, as much of it as image datasets use.
//!
//! ```text
//! Example  { Features features = 1; }
//! Features { map<string, Feature> feature = 1; }       // map entry: key = 1, value = 2
//! Feature  { oneof { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
//! BytesList { repeated bytes value = 1; }
//! FloatList { repeated float value = 1 [packed]; }
//! Int64List { repeated int64 value = 1 [packed]; }
//! ```
//!
//! Hand-written rather than generated (prost) because parsing must not copy: a parsed feature
//! borrows from the record, which borrows from the memory-mapped shard, so an image's bytes
//! reach the decoder without a copy. Unknown fields are skipped, packed and unpacked repeated
//! scalars are both accepted, and every length is bounds-checked, so a corrupt record is an
//! `Err` with a reason, never a panic.

/// One feature's values, borrowed from the encoded record.
#[derive(Debug, Clone, PartialEq)]
pub enum Feature<'a> {
    /// `bytes_list`.
    Bytes(Vec<&'a [u8]>),
    /// `int64_list`.
    Int64(Vec<i64>),
    /// `float_list`.
    Float(Vec<f32>),
}

/// A feature value to encode.
#[derive(Debug, Clone, Copy)]
pub enum FeatureValue<'a> {
    /// A one-element `bytes_list`.
    Bytes(&'a [u8]),
    /// A one-element `int64_list`.
    Int64(i64),
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn varint_len(mut value: u64) -> usize {
    let mut n = 1;
    while value >= 0x80 {
        value >>= 7;
        n += 1;
    }
    n
}

/// Field tag for a length-delimited field.
fn len_tag(field: u64) -> u64 {
    (field << 3) | 2
}

/// Encodes an `Example` with the given features, in the order given, into `out` (cleared first).
pub fn encode(out: &mut Vec<u8>, features: &[(&str, FeatureValue<'_>)]) {
    out.clear();
    // Sizes of each nested message, innermost first, so everything is written in one pass.
    let entry_sizes: Vec<(usize, usize, usize)> = features
        .iter()
        .map(|(name, value)| {
            let list = match value {
                FeatureValue::Bytes(b) => 1 + varint_len(b.len() as u64) + b.len(),
                FeatureValue::Int64(v) => {
                    let packed = varint_len(*v as u64);
                    1 + varint_len(packed as u64) + packed
                }
            };
            let feature = 1 + varint_len(list as u64) + list;
            let entry = 1
                + varint_len(name.len() as u64)
                + name.len()
                + 1
                + varint_len(feature as u64)
                + feature;
            (list, feature, entry)
        })
        .collect();
    let features_len: usize = entry_sizes
        .iter()
        .map(|&(_, _, entry)| 1 + varint_len(entry as u64) + entry)
        .sum();
    put_varint(out, len_tag(1));
    put_varint(out, features_len as u64);
    for ((name, value), (list, feature, entry)) in features.iter().zip(entry_sizes) {
        put_varint(out, len_tag(1)); // Features.feature (map entry)
        put_varint(out, entry as u64);
        put_varint(out, len_tag(1)); // entry key
        put_varint(out, name.len() as u64);
        out.extend_from_slice(name.as_bytes());
        put_varint(out, len_tag(2)); // entry value: Feature
        put_varint(out, feature as u64);
        match value {
            FeatureValue::Bytes(bytes) => {
                put_varint(out, len_tag(1)); // bytes_list
                put_varint(out, list as u64);
                put_varint(out, len_tag(1));
                put_varint(out, bytes.len() as u64);
                out.extend_from_slice(bytes);
            }
            FeatureValue::Int64(v) => {
                put_varint(out, len_tag(3)); // int64_list
                put_varint(out, list as u64);
                put_varint(out, len_tag(1)); // packed values
                put_varint(out, varint_len(*v as u64) as u64);
                put_varint(out, *v as u64);
            }
        }
    }
}

/// A cursor over protobuf fields.
struct Fields<'a> {
    data: &'a [u8],
}

/// One field: its number and value.
enum Field<'a> {
    Varint(u64),
    Fixed32(u32),
    Bytes(&'a [u8]),
}

impl<'a> Fields<'a> {
    fn varint(&mut self) -> Result<u64, String> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = self
                .data
                .split_first()
                .ok_or("protobuf: a varint runs past the end")?;
            self.data = rest;
            value |= u64::from(byte & 0x7F) << shift;
            if byte < 0x80 {
                return Ok(value);
            }
        }
        Err("protobuf: a varint is longer than 10 bytes".into())
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if n > self.data.len() {
            return Err(format!(
                "protobuf: a field of {n} bytes runs past the end ({} left)",
                self.data.len()
            ));
        }
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        Ok(head)
    }

    fn next(&mut self) -> Option<Result<(u64, Field<'a>), String>> {
        if self.data.is_empty() {
            return None;
        }
        Some((|| {
            let tag = self.varint()?;
            let field = tag >> 3;
            let value = match tag & 7 {
                0 => Field::Varint(self.varint()?),
                1 => {
                    self.take(8)?;
                    Field::Varint(0)
                }
                2 => {
                    let n = self.varint()?;
                    let n = usize::try_from(n).map_err(|_| "protobuf: absurd length")?;
                    Field::Bytes(self.take(n)?)
                }
                5 => Field::Fixed32(u32::from_le_bytes(
                    self.take(4)?.try_into().expect("4 bytes"),
                )),
                wire => return Err(format!("protobuf: unsupported wire type {wire}")),
            };
            Ok((field, value))
        })())
    }
}

fn fields(data: &[u8]) -> Fields<'_> {
    Fields { data }
}

/// Parses an encoded `Example` into `(name, feature)` pairs, in record order.
pub fn parse(record: &[u8]) -> Result<Vec<(&str, Feature<'_>)>, String> {
    let mut out = Vec::new();
    let mut example = fields(record);
    while let Some(field) = example.next() {
        let Ok((1, Field::Bytes(features))) = field else {
            field?;
            continue;
        };
        let mut features = fields(features);
        while let Some(entry) = features.next() {
            let Ok((1, Field::Bytes(entry))) = entry else {
                entry?;
                continue;
            };
            let (mut name, mut feature) = (None, None);
            let mut entry = fields(entry);
            while let Some(item) = entry.next() {
                match item? {
                    (1, Field::Bytes(key)) => {
                        name = Some(
                            std::str::from_utf8(key)
                                .map_err(|_| "a feature name is not UTF-8".to_string())?,
                        )
                    }
                    (2, Field::Bytes(value)) => feature = Some(parse_feature(value)?),
                    _ => {}
                }
            }
            if let (Some(name), Some(feature)) = (name, feature) {
                out.push((name, feature));
            }
        }
    }
    Ok(out)
}

fn parse_feature(data: &[u8]) -> Result<Feature<'_>, String> {
    let mut feature = fields(data);
    let mut result = Feature::Bytes(Vec::new());
    while let Some(item) = feature.next() {
        let (kind, Field::Bytes(list)) = item? else {
            continue;
        };
        let mut list = fields(list);
        result = match kind {
            1 => {
                let mut values = Vec::new();
                while let Some(v) = list.next() {
                    if let (1, Field::Bytes(b)) = v? {
                        values.push(b);
                    }
                }
                Feature::Bytes(values)
            }
            2 => {
                let mut values = Vec::new();
                while let Some(v) = list.next() {
                    match v? {
                        (1, Field::Fixed32(bits)) => values.push(f32::from_bits(bits)),
                        (1, Field::Bytes(packed)) => {
                            if packed.len() % 4 != 0 {
                                return Err("protobuf: packed floats not a multiple of 4".into());
                            }
                            values.extend(
                                packed
                                    .chunks_exact(4)
                                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))),
                            );
                        }
                        _ => {}
                    }
                }
                Feature::Float(values)
            }
            3 => {
                let mut values = Vec::new();
                while let Some(v) = list.next() {
                    match v? {
                        (1, Field::Varint(x)) => values.push(x as i64),
                        (1, Field::Bytes(packed)) => {
                            let mut packed = fields(packed);
                            while !packed.data.is_empty() {
                                values.push(packed.varint()? as i64);
                            }
                        }
                        _ => {}
                    }
                }
                Feature::Int64(values)
            }
            _ => continue,
        };
    }
    Ok(result)
}

/// The one value of the bytes feature `name`: `Err` with a reason when there is no such
/// feature, or it holds no value or several (a reader never guesses which one was meant).
pub fn bytes<'a>(features: &[(&str, Feature<'a>)], name: &str) -> Result<&'a [u8], String> {
    match features.iter().find(|(n, _)| *n == name) {
        Some((_, Feature::Bytes(values))) => only(values, name),
        Some(_) => Err(format!("{name} is not a bytes_list")),
        None => Err(format!("no {name} feature")),
    }
}

/// The one value of the int64 feature `name`: `Err` with a reason when there is no such
/// feature, or it holds no value or several (a multi-label record is not a class label).
pub fn int64(features: &[(&str, Feature<'_>)], name: &str) -> Result<i64, String> {
    match features.iter().find(|(n, _)| *n == name) {
        Some((_, Feature::Int64(values))) => only(values, name),
        Some(_) => Err(format!("{name} is not an int64_list")),
        None => Err(format!("no {name} feature")),
    }
}

fn only<T: Copy>(values: &[T], name: &str) -> Result<T, String> {
    match values {
        [value] => Ok(*value),
        _ => Err(format!(
            "{name} holds {} values, one expected",
            values.len()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn encodes_what_protobuf_would() {
        // Example{features{feature{key: "a", value: {int64_list{value: [5]}}}}}, by hand.
        let mut out = Vec::new();
        encode(&mut out, &[("a", FeatureValue::Int64(5))]);
        let expected = [
            0x0a, 0x0c, // Example.features: 12 bytes
            0x0a, 0x0a, // Features.feature map entry: 10 bytes
            0x0a, 0x01, b'a', // entry key
            0x12, 0x05, // entry value: Feature, 5 bytes
            0x1a, 0x03, // Feature.int64_list: 3 bytes
            0x0a, 0x01, 0x05, // Int64List.value, packed: [5]
        ];
        assert_eq!(out, expected);
        assert_eq!(parse(&out).unwrap(), vec![("a", Feature::Int64(vec![5]))]);
    }

    #[test]
    fn reads_unpacked_ints_and_floats_and_skips_unknown_fields() {
        // Feature with int64_list holding unpacked 7 and 300, plus an unknown field 9 (varint).
        let int_list = [0x08, 0x07, 0x08, 0xac, 0x02];
        let mut feature = vec![0x1a, int_list.len() as u8];
        feature.extend_from_slice(&int_list);
        let mut entry = vec![0x0a, 0x01, b'n', 0x12, feature.len() as u8];
        entry.extend_from_slice(&feature);
        entry.extend_from_slice(&[0x48, 0x01]); // field 9, varint 1
        let mut features = vec![0x0a, entry.len() as u8];
        features.extend_from_slice(&entry);
        let mut example = vec![0x0a, features.len() as u8];
        example.extend_from_slice(&features);
        let parsed = parse(&example).unwrap();
        assert_eq!(parsed[0].1, Feature::Int64(vec![7, 300]));
        // Regression: a two-valued label read as its first value; it is not a class label.
        assert_eq!(
            int64(&parsed, "n").unwrap_err(),
            "n holds 2 values, one expected"
        );
        assert_eq!(int64(&parsed, "m").unwrap_err(), "no m feature");
        assert_eq!(bytes(&parsed, "n").unwrap_err(), "n is not a bytes_list");
    }

    #[test]
    fn corrupt_records_are_errors() {
        let mut out = Vec::new();
        encode(
            &mut out,
            &[("image/encoded", FeatureValue::Bytes(b"abcdef"))],
        );
        for cut in 1..out.len() {
            assert!(parse(&out[..cut]).is_err(), "cut at {cut} parsed");
        }
        assert!(parse(&[0x0f]).unwrap_err().contains("wire type 7"));
    }

    proptest! {
        #[test]
        fn round_trips(
            payload in proptest::collection::vec(any::<u8>(), 0..3000),
            label in any::<i64>(),
            name in "[a-z/]{1,20}",
        ) {
            let mut out = Vec::new();
            encode(&mut out, &[
                ("image/encoded", FeatureValue::Bytes(&payload)),
                (name.as_str(), FeatureValue::Int64(label)),
            ]);
            let parsed = parse(&out).unwrap();
            prop_assert_eq!(bytes(&parsed, "image/encoded"), Ok(&payload[..]));
            if name != "image/encoded" {
                prop_assert_eq!(int64(&parsed, &name), Ok(label));
            }
        }
    }
}
