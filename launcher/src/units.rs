//! Byte sizes as people type and read them ("24GiB", "600 MiB", "8GB"). The
//! parser and formatter live in `krasis_common::size`, shared with the
//! runtime, so a size means the same bytes in the launcher, a profile and
//! every `krasis-runtime` flag.

pub use krasis_common::size::{format_size as fmt_bytes, format_size_exact, parse_size};

/// Parameter counts as people read them: `30.5B`, `145.2M`, `9.4K` (never
/// `0.0B`); defined once in `krasis_common` for the runtime's text too.
pub use krasis_common::inspect::format_count as fmt_count;

/// A duration as people read it: `850 ms`, `12.3 s`, `4 min 05 s`,
/// `2 h 03 min` (precision shrinks as the number grows).
pub fn fmt_duration(d: std::time::Duration) -> String {
    let s = d.as_secs_f64();
    if s < 1.0 {
        format!("{:.0} ms", s * 1000.0)
    } else if s < 60.0 {
        format!("{s:.1} s")
    } else if s < 3600.0 {
        let s = s.round() as u64;
        format!("{} min {:02} s", s / 60, s % 60)
    } else {
        let m = (s / 60.0).round() as u64;
        format!("{} h {:02} min", m / 60, m % 60)
    }
}

/// Milliseconds as measured by the engine (TTFT, copy time per token).
pub fn fmt_ms(ms: f64) -> String {
    if !ms.is_finite() || ms < 0.0 {
        "?".into()
    } else if ms < 10.0 {
        format!("{ms:.2} ms")
    } else if ms < 1000.0 {
        format!("{ms:.0} ms")
    } else {
        fmt_duration(std::time::Duration::from_secs_f64(ms / 1000.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_read_with_a_unit_never_zero_billions() {
        assert_eq!(fmt_count(30_532_122_624), "30.5B");
        assert_eq!(fmt_count(145_200_000), "145.2M");
        assert_eq!(fmt_count(9_400), "9.4K");
        assert_eq!(fmt_count(2_097_152), "2.1M");
    }

    #[test]
    fn sizes_parse_and_print() {
        assert_eq!(parse_size("8GiB").unwrap(), 8 << 30);
        assert_eq!(parse_size("8GB").unwrap(), 8_000_000_000);
        assert!(parse_size("8G").unwrap_err().to_string().contains("8GiB"));
        assert_eq!(fmt_bytes(3 << 29), "1.5 GiB");
    }

    #[test]
    fn durations_read_naturally() {
        use std::time::Duration;
        assert_eq!(fmt_duration(Duration::from_millis(850)), "850 ms");
        assert_eq!(fmt_duration(Duration::from_millis(12_340)), "12.3 s");
        assert_eq!(fmt_duration(Duration::from_secs(245)), "4 min 05 s");
        assert_eq!(fmt_duration(Duration::from_secs(7380)), "2 h 03 min");
        assert_eq!(fmt_ms(1.234), "1.23 ms");
        assert_eq!(fmt_ms(412.4), "412 ms");
        assert_eq!(fmt_ms(1520.0), "1.5 s");
        assert_eq!(fmt_ms(f64::NAN), "?");
    }
}
