//! `tojson` as transformers defines it: Python's
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//! sort_keys=False)`. Templates put its output verbatim into prompts, so the
//! bytes (", " and ": " spacing, key order, unescaped non-ASCII, Python float
//! repr) must match what the model was trained on.

use std::fmt::Write as _;

use minijinja::value::Kwargs;
use minijinja::{Error, ErrorKind, Value};
use serde_json::Value as Json;

/// Python `json.dumps` options.
#[derive(Debug, Clone)]
pub struct DumpOptions {
    pub ensure_ascii: bool,
    /// `None` = single line; `Some(s)` = newline + `s` repeated per level.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
}

impl Default for DumpOptions {
    fn default() -> Self {
        Self {
            ensure_ascii: false,
            indent: None,
            item_separator: ", ".into(),
            key_separator: ": ".into(),
            sort_keys: false,
        }
    }
}

/// Serialize like Python's `json.dumps`.
pub fn dumps(v: &Json, opts: &DumpOptions) -> String {
    let mut out = String::new();
    write_value(&mut out, v, opts, 0);
    out
}

/// The minijinja filter: `x | tojson(indent=2, sort_keys=true, ...)`.
pub(super) fn tojson_filter(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let mut opts = DumpOptions::default();
    if let Some(a) = kwargs.get::<Option<bool>>("ensure_ascii")? {
        opts.ensure_ascii = a;
    }
    if let Some(s) = kwargs.get::<Option<bool>>("sort_keys")? {
        opts.sort_keys = s;
    }
    if let Some(ind) = kwargs.get::<Option<Value>>("indent")?
        && !ind.is_none()
    {
        opts.indent = Some(match ind.as_str() {
            Some(s) => s.to_string(),
            None => {
                let n = i64::try_from(ind.clone()).map_err(|_| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an int or a string",
                    )
                })?;
                " ".repeat(usize::try_from(n).unwrap_or(0))
            }
        });
        // Python drops the space after ',' when indenting.
        opts.item_separator = ",".into();
    }
    if let Some(seps) = kwargs.get::<Option<Vec<String>>>("separators")? {
        let [item, key] = <[String; 2]>::try_from(seps).map_err(|_| {
            Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair of strings",
            )
        })?;
        opts.item_separator = item;
        opts.key_separator = key;
    }
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: value is not JSON-serializable: {e}"),
        )
    })?;
    Ok(Value::from(dumps(&json, &opts)))
}

fn newline(out: &mut String, opts: &DumpOptions, level: usize) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn write_value(out: &mut String, v: &Json, opts: &DumpOptions, level: usize) {
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Number(n) => {
            if let Some(f) = n.as_f64().filter(|_| n.is_f64()) {
                out.push_str(&python_float_repr(f));
            } else {
                let _ = write!(out, "{n}");
            }
        }
        Json::String(s) => write_string(out, s, opts.ensure_ascii),
        Json::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_separator);
                }
                newline(out, opts, level + 1);
                write_value(out, item, opts, level + 1);
            }
            newline(out, opts, level);
            out.push(']');
        }
        Json::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &Json)> = map.iter().collect();
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, val)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_separator);
                }
                newline(out, opts, level + 1);
                write_string(out, k, opts.ensure_ascii);
                out.push_str(&opts.key_separator);
                write_value(out, val, opts, level + 1);
            }
            newline(out, opts, level);
            out.push('}');
        }
    }
}

fn write_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, fixed notation for
/// exponents in [-4, 16), otherwise `1.5e-07` style.
pub fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sign = if f.is_sign_negative() { "-" } else { "" };
    let sci = format!("{:e}", f.abs());
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            let (int_part, frac) = if digits.len() > int_len {
                (digits[..int_len].to_string(), digits[int_len..].to_string())
            } else {
                (format!("{digits:0<int_len$}"), "0".to_string())
            };
            format!("{sign}{int_part}.{frac}")
        } else {
            let zeros = "0".repeat((-exp - 1) as usize);
            format!("{sign}0.{zeros}{digits}")
        }
    } else {
        let mant = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mant}e{esign}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn float_repr_matches_python() {
        // Expected strings are Python 3 `repr(x)`.
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (100.0, "100.0"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (123456.789, "123456.789"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (5e-324, "5e-324"),
        ];
        for (f, want) in cases {
            assert_eq!(python_float_repr(f), want, "{f:e}");
        }
    }

    #[test]
    fn dumps_matches_python_defaults() {
        // json.dumps(v, ensure_ascii=False)
        let v =
            json!({"b": 1, "a": [1, 2.0, null, true], "ü": "日本\n\"q\"\u{1}\t", "e": {}, "l": []});
        assert_eq!(
            dumps(&v, &DumpOptions::default()),
            "{\"b\": 1, \"a\": [1, 2.0, null, true], \"ü\": \"日本\\n\\\"q\\\"\\u0001\\t\", \"e\": {}, \"l\": []}"
        );
    }

    #[test]
    fn dumps_indent_and_ascii_match_python() {
        // json.dumps({"x": [1, {"y": "é😀"}], "z": {}}, indent=2, ensure_ascii=True)
        let v = json!({"x": [1, {"y": "é😀"}], "z": {}});
        let opts = DumpOptions {
            ensure_ascii: true,
            indent: Some("  ".into()),
            item_separator: ",".into(),
            ..DumpOptions::default()
        };
        assert_eq!(
            dumps(&v, &opts),
            "{\n  \"x\": [\n    1,\n    {\n      \"y\": \"\\u00e9\\ud83d\\ude00\"\n    }\n  ],\n  \"z\": {}\n}"
        );
    }
}
