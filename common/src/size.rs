//! Byte sizes as people type and read them, parsed the same way by every
//! flag of the launcher and the runtime (`--vram-limit`, `--shard-size`,
//! `--hcs-exactness`, the TUI's VRAM field, ...).
//!
//! Rules:
//! - `KiB`, `MiB`, `GiB`, `TiB` are powers of 1024; `KB`, `MB`, `GB`, `TB`
//!   are powers of 1000 (`8GB` is 8 000 000 000 bytes).
//! - `B` or no unit is a byte count, which must be whole.
//! - Units are case-insensitive, may follow a space, and the number may have
//!   a decimal fraction (`1.5GiB`; rounded to the nearest byte).
//! - The bare letters `K`, `M`, `G`, `T` are refused as ambiguous, with the
//!   two spellings that are not; anything else is refused with what to write.

use std::fmt;

/// Why a size could not be parsed. The message says what to write instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SizeError {
    pub input: String,
    pub kind: SizeErrorKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SizeErrorKind {
    /// Empty text.
    Empty,
    /// The text does not start with a plain decimal number.
    NotANumber,
    /// `K`, `M`, `G` or `T` alone: binary or decimal? (`number`, `letter`).
    Ambiguous { number: String, letter: char },
    /// A unit that is not one of the eight.
    UnknownUnit(String),
    /// A fraction of a byte (`1.5B`, `2.5`).
    FractionalBytes,
    /// More than `u64::MAX` bytes, or more fraction digits than is sensible.
    TooLarge,
}

const WHAT_TO_WRITE: &str = "write a number with B, KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000), e.g. 24GiB, 600MiB, 8GB or a byte count";

impl fmt::Display for SizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.input;
        match &self.kind {
            SizeErrorKind::Empty => write!(f, "empty size; {WHAT_TO_WRITE}"),
            SizeErrorKind::NotANumber => write!(f, "'{s}' is not a size; {WHAT_TO_WRITE}"),
            SizeErrorKind::Ambiguous { number, letter } => {
                let power = match letter {
                    'K' => (10, 3),
                    'M' => (20, 6),
                    'G' => (30, 9),
                    _ => (40, 12),
                };
                write!(
                    f,
                    "'{s}' is ambiguous: write {number}{letter}iB (2^{}) or {number}{letter}B (10^{})",
                    power.0, power.1
                )
            }
            SizeErrorKind::UnknownUnit(u) => {
                write!(f, "'{s}': unknown size unit '{u}'; {WHAT_TO_WRITE}")
            }
            SizeErrorKind::FractionalBytes => write!(
                f,
                "'{s}' is a fraction of a byte; a byte count must be a whole number (or use a unit, e.g. 1.5GiB)"
            ),
            SizeErrorKind::TooLarge => write!(f, "'{s}' is too large a size"),
        }
    }
}

impl std::error::Error for SizeError {}

/// Parses a byte size by the rules in the module documentation.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let err = |kind| SizeError {
        input: s.trim().to_string(),
        kind,
    };
    let t = s.trim();
    if t.is_empty() {
        return Err(err(SizeErrorKind::Empty));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim_start();
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() || frac.contains('.') || num.ends_with('.') {
        return Err(err(SizeErrorKind::NotANumber));
    }
    let multiplier: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        u @ ("k" | "m" | "g" | "t") => {
            return Err(err(SizeErrorKind::Ambiguous {
                number: num.to_string(),
                letter: u.to_ascii_uppercase().chars().next().unwrap_or('G'),
            }));
        }
        _ => return Err(err(SizeErrorKind::UnknownUnit(unit.to_string()))),
    };
    // Exact integer arithmetic: int * m + round(frac * m / 10^len).
    if int.len() > 20 || frac.len() > 18 {
        return Err(err(SizeErrorKind::TooLarge));
    }
    let int_v: u128 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| err(SizeErrorKind::NotANumber))?
    };
    let mut bytes = int_v * multiplier;
    let frac_digits = frac.trim_end_matches('0');
    if !frac_digits.is_empty() {
        let den = 10u128.pow(frac_digits.len() as u32);
        let num_v: u128 = frac_digits
            .parse()
            .map_err(|_| err(SizeErrorKind::NotANumber))?;
        let part = num_v * multiplier;
        if multiplier == 1 {
            return Err(err(SizeErrorKind::FractionalBytes));
        }
        bytes += (part + den / 2) / den;
    }
    u64::try_from(bytes).map_err(|_| err(SizeErrorKind::TooLarge))
}

/// Formats bytes with a binary unit for reading, e.g. `17.3 GiB` (`12 B`
/// below 1 KiB). One decimal: for display, not for round trips.
pub fn format_size(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Formats bytes so that [`parse_size`] gives them back exactly: the largest
/// binary unit that divides them (`20GiB`), else a byte count.
pub fn format_size_exact(b: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if b != 0 && b.is_multiple_of(1u64 << shift) {
            return format!("{}{unit}", b >> shift);
        }
    }
    b.to_string()
}

/// Inputs and what [`parse_size`] makes of them (`None`: refused). Every
/// size flag of the launcher and the runtime is tested over this table, so
/// the two binaries cannot read the same text differently.
#[doc(hidden)]
pub const EXAMPLES: &[(&str, Option<u64>)] = &[
    ("4096", Some(4096)),
    ("0", Some(0)),
    ("512B", Some(512)),
    ("512 b", Some(512)),
    ("8GiB", Some(8 << 30)),
    ("8gib", Some(8 << 30)),
    ("8 GiB", Some(8 << 30)),
    ("600 MiB", Some(600 << 20)),
    ("1.5GiB", Some(3 << 29)),
    ("2KiB", Some(2048)),
    ("1TiB", Some(1 << 40)),
    ("8GB", Some(8_000_000_000)),
    ("8gb", Some(8_000_000_000)),
    ("500 MB", Some(500_000_000)),
    ("1.5kb", Some(1500)),
    ("2TB", Some(2_000_000_000_000)),
    ("0.5MiB", Some(1 << 19)),
    (".5GB", Some(500_000_000)),
    ("8G", None),
    ("8g", None),
    ("600M", None),
    ("4K", None),
    ("1T", None),
    ("1.5", None),
    ("1.5B", None),
    ("", None),
    ("lots", None),
    ("3 parsecs", None),
    ("-1GiB", None),
    ("1e9", None),
    ("1.2.3GiB", None),
    ("8.GiB", None),
    ("20000000TB", None),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rule_on_the_shared_table() {
        for (input, want) in EXAMPLES {
            assert_eq!(parse_size(input).ok(), *want, "{input:?}");
        }
    }

    #[test]
    fn binary_and_decimal_units_differ() {
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("1GB").unwrap(), 1_000_000_000);
        assert_eq!(parse_size("1KiB").unwrap(), 1024);
        assert_eq!(parse_size("1KB").unwrap(), 1000);
    }

    #[test]
    fn refusals_say_what_to_write() {
        assert_eq!(
            parse_size("8G").unwrap_err().to_string(),
            "'8G' is ambiguous: write 8GiB (2^30) or 8GB (10^9)"
        );
        assert_eq!(
            parse_size("600m").unwrap_err().to_string(),
            "'600m' is ambiguous: write 600MiB (2^20) or 600MB (10^6)"
        );
        let e = parse_size("3 parsecs").unwrap_err().to_string();
        assert!(e.contains("'parsecs'") && e.contains("GiB"), "{e}");
        let e = parse_size("lots").unwrap_err().to_string();
        assert!(e.contains("e.g. 24GiB"), "{e}");
        assert!(
            parse_size("2.5")
                .unwrap_err()
                .to_string()
                .contains("whole number")
        );
        assert_eq!(
            parse_size("99999999999TiB").unwrap_err().kind,
            SizeErrorKind::TooLarge
        );
    }

    #[test]
    fn largest_values_are_exact() {
        assert_eq!(parse_size("18446744073709551615").unwrap(), u64::MAX);
        assert!(parse_size("18446744073709551616").is_err());
        assert_eq!(parse_size("16777215TiB").unwrap(), 16777215u64 << 40);
        // Rounded to the nearest byte.
        assert_eq!(parse_size("0.1GiB").unwrap(), 107_374_182);
    }

    #[test]
    fn formatting_reads_and_round_trips() {
        assert_eq!(format_size(3 << 29), "1.5 GiB");
        assert_eq!(format_size(12), "12 B");
        for b in [0, 1, 1023, 1024, 3 << 29, 20 << 30, 8_000_000_000, 1 << 40] {
            assert_eq!(parse_size(&format_size_exact(b)).unwrap(), b, "{b}");
        }
        assert_eq!(format_size_exact(20 << 30), "20GiB");
    }
}
