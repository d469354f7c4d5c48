//! Byte counts as people write them in options and environment variables: `1000`, `64K`,
//! `128MiB`, `1G`.

/// The environment variable `name` read by `parse`: `None` where it is unset or blank.
///
/// # Errors
/// A message naming the variable, where its value is not UTF-8 or `parse` refuses it (its
/// reason says what the value is).
pub fn from_env<T>(
    name: &str,
    parse: impl FnOnce(&str) -> std::result::Result<T, String>,
) -> std::result::Result<Option<T>, String> {
    match std::env::var(name) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(text)) => Err(format!("{name}={text:?}: not UTF-8")),
        Ok(text) if text.trim().is_empty() => Ok(None),
        Ok(text) => parse(&text)
            .map(Some)
            .map_err(|reason| format!("{name}: {reason}")),
    }
}

/// Parses a byte count: `1000`, `64K`, `128MiB`, `1G`, ... (decimal K/M/G/T, binary
/// KiB/MiB/GiB/TiB).
pub fn parse_bytes(text: &str) -> std::result::Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?}: expected a number of bytes, e.g. 128MiB"))?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "t" | "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        other => {
            return Err(format!(
                "{text:?}: unknown unit {other:?} (a whole number, then B, K, M, G, T, KiB, \
                 MiB, GiB or TiB)"
            ));
        }
    };
    number
        .checked_mul(scale)
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("{text:?}: must be at least 1 byte and below 2^64 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_parse_with_units() {
        assert_eq!(parse_bytes("128MiB"), Ok(128 << 20));
        assert_eq!(parse_bytes("2G"), Ok(2_000_000_000));
        assert_eq!(parse_bytes(" 7 "), Ok(7));
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("5 parsecs").is_err());
        assert!(parse_bytes("99999999999TiB").is_err());
    }
}
