//! Byte sizes as people type and read them ("24GiB", "600 MiB", "8GB"). The
//! parser and formatter live in `krasis_common::size`, shared with the
//! runtime, so a size means the same bytes in the launcher, a profile and
//! every `krasis-runtime` flag.

pub use krasis_common::size::{format_size as fmt_bytes, format_size_exact, parse_size};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_print() {
        assert_eq!(parse_size("8GiB").unwrap(), 8 << 30);
        assert_eq!(parse_size("8GB").unwrap(), 8_000_000_000);
        assert!(parse_size("8G").unwrap_err().to_string().contains("8GiB"));
        assert_eq!(fmt_bytes(3 << 29), "1.5 GiB");
    }
}
