//! Checks a JSON value against the key table of a document such as
//! `docs/probe-json.md`, so the document is the one definition of the shape
//! and a test fails when output and document part ways.
//!
//! A table row is `| `path` | type | meaning |`: `path` is dotted, with `[]`
//! for "each element of the array" (`models[].facts.top_k`); `type` is one or
//! more of `integer`, `string`, `boolean`, `object`, `array of T`, or a
//! quoted string literal, joined by ` or ` (`"ok" or "error"`,
//! `string or null`). Every object must have exactly the documented keys.

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};

#[derive(Debug, Clone, PartialEq)]
enum Ty {
    Integer,
    String,
    Boolean,
    Object,
    Null,
    Literal(String),
    Array(Box<Ty>),
}

fn parse_one(s: &str) -> Ty {
    let s = s.trim();
    if let Some(rest) = s.strip_prefix("array of ") {
        return Ty::Array(Box::new(parse_one(rest)));
    }
    match s {
        "integer" => Ty::Integer,
        "string" => Ty::String,
        "boolean" => Ty::Boolean,
        "object" => Ty::Object,
        "null" => Ty::Null,
        _ if s.len() >= 2 && s.starts_with('"') && s.ends_with('"') => {
            Ty::Literal(s[1..s.len() - 1].to_string())
        }
        other => panic!("unknown type {other:?} in the document's key table"),
    }
}

fn matches(ty: &Ty, v: &Value) -> bool {
    match ty {
        Ty::Integer => v.is_u64() || v.is_i64(),
        Ty::String => v.is_string(),
        Ty::Boolean => v.is_boolean(),
        Ty::Object => v.is_object(),
        Ty::Null => v.is_null(),
        Ty::Literal(l) => v.as_str() == Some(l.as_str()),
        Ty::Array(_) => v.is_array(),
    }
}

pub struct Spec {
    types: BTreeMap<String, Vec<Ty>>,
}

impl Spec {
    /// The key table of a Markdown document.
    pub fn from_doc(doc: &str) -> Spec {
        let mut types = BTreeMap::new();
        for line in doc.lines() {
            let Some(rest) = line.trim().strip_prefix("| `") else {
                continue;
            };
            let (path, rest) = rest.split_once('`').expect("path ends with a backtick");
            let ty = rest
                .trim_start()
                .strip_prefix('|')
                .and_then(|r| r.split('|').next())
                .expect("a type column")
                .trim();
            let alts = ty.split(" or ").map(parse_one).collect();
            assert!(
                types.insert(path.to_string(), alts).is_none(),
                "{path} documented twice"
            );
        }
        assert!(!types.is_empty(), "no key table found in the document");
        Spec { types }
    }

    pub fn paths(&self) -> BTreeSet<String> {
        self.types.keys().cloned().collect()
    }

    /// Every key and type of `v`; returns the documented paths it reached.
    pub fn check(&self, v: &Value) -> Result<BTreeSet<String>, String> {
        let mut seen = BTreeSet::new();
        let mut errors = Vec::new();
        self.object("", v, &mut seen, &mut errors);
        if errors.is_empty() {
            Ok(seen)
        } else {
            Err(errors.join("\n"))
        }
    }

    fn children(&self, parent: &str) -> BTreeSet<&str> {
        self.types
            .keys()
            .filter_map(|k| {
                let name = if parent.is_empty() {
                    k.as_str()
                } else {
                    k.strip_prefix(parent)?.strip_prefix('.')?
                };
                (!name.contains('.')).then_some(name)
            })
            .collect()
    }

    fn object(&self, at: &str, v: &Value, seen: &mut BTreeSet<String>, errors: &mut Vec<String>) {
        let Some(obj) = v.as_object() else {
            errors.push(format!("{}: expected an object, got {v}", at_or_root(at)));
            return;
        };
        let want = self.children(at);
        let join = |k: &str| {
            if at.is_empty() {
                k.to_string()
            } else {
                format!("{at}.{k}")
            }
        };
        for k in obj.keys() {
            if !want.contains(k.as_str()) {
                errors.push(format!("{}: key not in the document", join(k)));
            }
        }
        for k in &want {
            let path = join(k);
            match obj.get(*k) {
                None => errors.push(format!("{path}: documented key missing")),
                Some(val) => self.value(&path, &self.types[&path], val, seen, errors),
            }
        }
    }

    fn value(
        &self,
        path: &str,
        alts: &[Ty],
        v: &Value,
        seen: &mut BTreeSet<String>,
        errors: &mut Vec<String>,
    ) {
        seen.insert(path.to_string());
        let Some(ty) = alts.iter().find(|t| matches(t, v)) else {
            errors.push(format!("{path}: {v} is not {alts:?}"));
            return;
        };
        match ty {
            Ty::Object => self.object(path, v, seen, errors),
            Ty::Array(elem) => {
                let elem_path = format!("{path}[]");
                for e in v.as_array().into_iter().flatten() {
                    self.value(&elem_path, std::slice::from_ref(elem), e, seen, errors);
                }
            }
            _ => {}
        }
    }
}

fn at_or_root(at: &str) -> &str {
    if at.is_empty() { "(top level)" } else { at }
}
