//! Kubernetes quantities in bytes: parse `10Gi`/`1.5G`/`1e9`, round up to allocation units (the
//! Go library's `RoundUpSize`/`RoundUpToGiB`), and print bytes back as a quantity.

use std::fmt;

/// One kibibyte.
pub const KIB: u64 = 1 << 10;
/// One mebibyte.
pub const MIB: u64 = 1 << 20;
/// One gibibyte.
pub const GIB: u64 = 1 << 30;
/// One tebibyte.
pub const TIB: u64 = 1 << 40;

/// A quantity that is not a valid, non-negative byte count.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantityError {
    /// The text given.
    pub text: String,
    /// What is wrong with it.
    pub why: &'static str,
}

impl fmt::Display for QuantityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "quantity {:?}: {}", self.text, self.why)
    }
}

impl std::error::Error for QuantityError {}

/// Parses a Kubernetes quantity into bytes, rounding fractions of a byte up.
pub fn parse_quantity(text: &str) -> Result<u64, QuantityError> {
    let error = |why| QuantityError {
        text: text.to_owned(),
        why,
    };
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() {
        return Err(error("no number"));
    }
    if fraction.contains('.') || fraction.len() > 18 {
        return Err(error("malformed number"));
    }
    // value = digits / 10^fraction_len * multiplier
    let digits: u128 = format!("{whole}{fraction}")
        .parse()
        .map_err(|_| error("number too large"))?;
    let mut numerator = digits;
    let mut denominator: u128 = 10u128.pow(fraction.len() as u32);
    let (scale_num, scale_den): (u128, u128) = match suffix {
        "" => (1, 1),
        "m" => (1, 1000),
        "k" => (1_000, 1),
        "M" => (1_000_000, 1),
        "G" => (1_000_000_000, 1),
        "T" => (1_000_000_000_000, 1),
        "P" => (1_000_000_000_000_000, 1),
        "E" => (1_000_000_000_000_000_000, 1),
        "Ki" => (1 << 10, 1),
        "Mi" => (1 << 20, 1),
        "Gi" => (1 << 30, 1),
        "Ti" => (1 << 40, 1),
        "Pi" => (1 << 50, 1),
        "Ei" => (1 << 60, 1),
        exponent if exponent.starts_with(['e', 'E']) => {
            let power: i32 = exponent[1..].parse().map_err(|_| error("unknown suffix"))?;
            if power.unsigned_abs() > 30 {
                return Err(error("exponent out of range"));
            }
            let factor = 10u128.pow(power.unsigned_abs());
            if power >= 0 { (factor, 1) } else { (1, factor) }
        }
        _ => {
            return Err(error(
                "unknown suffix (use Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P, E, m or e<N>)",
            ));
        }
    };
    numerator = numerator
        .checked_mul(scale_num)
        .ok_or_else(|| error("too large"))?;
    denominator = denominator
        .checked_mul(scale_den)
        .ok_or_else(|| error("too large"))?;
    let bytes = numerator.div_ceil(denominator);
    u64::try_from(bytes).map_err(|_| error("too large"))
}

/// How many `allocation_unit`s hold `bytes` (rounded up): the Go library's `RoundUpSize`.
/// An allocation unit of 0 is treated as 1.
pub fn round_up_size(bytes: u64, allocation_unit: u64) -> u64 {
    bytes.div_ceil(allocation_unit.max(1))
}

/// How many GiB hold `bytes` (rounded up): the Go library's `RoundUpToGiB`.
pub fn round_up_to_gib(bytes: u64) -> u64 {
    round_up_size(bytes, GIB)
}

/// `bytes` as a quantity with the largest binary suffix that divides it exactly (`1Gi`, `1536Mi`).
pub fn format_quantity(bytes: u64) -> String {
    for (suffix, unit) in [
        ("Ei", 1u64 << 60),
        ("Pi", 1 << 50),
        ("Ti", TIB),
        ("Gi", GIB),
        ("Mi", MIB),
        ("Ki", KIB),
    ] {
        if bytes >= unit && bytes.is_multiple_of(unit) {
            return format!("{}{suffix}", bytes / unit);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_decimal_fraction_and_exponent_forms() {
        assert_eq!(parse_quantity("1Gi"), Ok(GIB));
        assert_eq!(parse_quantity("1.5Gi"), Ok(GIB + GIB / 2));
        assert_eq!(parse_quantity("500M"), Ok(500_000_000));
        assert_eq!(parse_quantity("1k"), Ok(1000));
        assert_eq!(parse_quantity("1e3"), Ok(1000));
        assert_eq!(parse_quantity("12345"), Ok(12345));
        assert_eq!(
            parse_quantity("1500m"),
            Ok(2),
            "fractions of a byte round up"
        );
        assert_eq!(parse_quantity(".5Ki"), Ok(512));
    }

    #[test]
    fn refuses_garbage_with_a_reason() {
        for text in ["", "Gi", "1Gb", "-1Gi", "1..2", "1e99", "99999999999Ei"] {
            let error = parse_quantity(text).unwrap_err();
            assert!(error.to_string().starts_with("quantity"), "{text}: {error}");
        }
    }

    #[test]
    fn rounds_up_like_the_go_library() {
        assert_eq!(round_up_size(1, GIB), 1);
        assert_eq!(round_up_size(GIB, GIB), 1);
        assert_eq!(round_up_size(GIB + 1, GIB), 2);
        assert_eq!(round_up_size(0, GIB), 0);
        assert_eq!(round_up_size(10, 0), 10);
        assert_eq!(round_up_to_gib(1_500_000_000), 2);
    }

    #[test]
    fn formats_with_the_largest_exact_suffix() {
        assert_eq!(format_quantity(GIB), "1Gi");
        assert_eq!(format_quantity(GIB + GIB / 2), "1536Mi");
        assert_eq!(format_quantity(1000), "1000");
        assert_eq!(format_quantity(0), "0");
        assert_eq!(parse_quantity(&format_quantity(3 * TIB)), Ok(3 * TIB));
    }
}
