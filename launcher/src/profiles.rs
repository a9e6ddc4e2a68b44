//! Saved launch profiles: TOML files `<config>/profiles/<name>.toml`,
//!
//! ```toml
//! schema = 1
//! name = "qwen3-30b"
//! description = "optional"
//!
//! [options]            # krasis_common::LaunchOptions, unknown keys refused
//! model = "/models/Qwen3-30B-A3B"
//! context_length = 32768
//! ```
//!
//! Written atomically (temp file in the same directory, then rename). A bad
//! profile is refused with the file, line, key and reason.
//!
//! Profiles never hold an API key: `api_key` in a file is refused, and a key
//! held in memory (typed in the TUI, or from `KRASIS_API_KEY`) is left out
//! when saving. A profile names a key file instead (`api_key_file`).
//!
//! The repository's `profiles/*.toml` ship inside the binary as examples
//! ([`examples`]); `--profile NAME` finds the user's own profile first, then
//! an example. A profile's `model` may be a name looked up in the model roots
//! ([`resolve`]).

pub mod examples;
pub mod resolve;

use krasis_common::LaunchOptions;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const SCHEMA: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub schema: u32,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    pub options: LaunchOptions,
}

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("{file}:{line}:{column}: key '{key}': {reason}")]
    Invalid {
        file: PathBuf,
        line: usize,
        column: usize,
        key: String,
        reason: String,
    },
    #[error("{file}: {reason}")]
    Rejected { file: PathBuf, reason: String },
    #[error(
        "no profile named '{name}' in {dir}, and no shipped example of that name (see `krasis profiles list`)"
    )]
    NotFound { name: String, dir: PathBuf },
    #[error(
        "'{0}' is not a valid profile name; use letters, digits, '-', '_' and '.' (not starting with '.')"
    )]
    BadName(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ProfileError + '_ {
    move |source| ProfileError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub fn check_name(name: &str) -> Result<(), ProfileError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(ProfileError::BadName(name.to_string()))
    }
}

/// Parses profile text; `file` is only used in messages.
pub fn parse(text: &str, file: &Path) -> Result<Profile, ProfileError> {
    // Check the schema first so a future-version file gets the right message
    // rather than an unknown-key complaint.
    if let Ok(v) = text.parse::<toml::Table>() {
        match v.get("schema").and_then(|s| s.as_integer()) {
            Some(s) if s == i64::from(SCHEMA) => {}
            Some(s) => {
                return Err(ProfileError::Rejected {
                    file: file.to_path_buf(),
                    reason: format!(
                        "schema {s} is not supported by this krasis (it reads schema {SCHEMA})"
                    ),
                });
            }
            None => {
                return Err(ProfileError::Rejected {
                    file: file.to_path_buf(),
                    reason: format!("missing `schema = {SCHEMA}` at the top"),
                });
            }
        }
    }
    let p: Profile = toml::from_str(text).map_err(|e| located(text, file, &e))?;
    if p.options.api_key.is_some() {
        return Err(ProfileError::Rejected {
            file: file.to_path_buf(),
            reason: "options.api_key: profiles do not hold API keys (anyone who can read the file, or a copy of it, has the key). Remove the line, put the key in a file only you can read (chmod 600) and set `api_key_file = \"PATH\"`, or set KRASIS_API_KEY".into(),
        });
    }
    p.options.validate().map_err(|e| ProfileError::Rejected {
        file: file.to_path_buf(),
        reason: format!("options.{}: {}", e.option, e.reason),
    })?;
    check_name(&p.name).map_err(|e| ProfileError::Rejected {
        file: file.to_path_buf(),
        reason: e.to_string(),
    })?;
    Ok(p)
}

/// Turns a toml error into file:line:column, the key on that line and the reason.
fn located(text: &str, file: &Path, e: &toml::de::Error) -> ProfileError {
    let (line, column, key) = match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let line_start = before.rfind('\n').map_or(0, |i| i + 1);
            let column = span.start - line_start + 1;
            let line_text = text[line_start..].lines().next().unwrap_or("");
            let key = line_text
                .split_once('=')
                .map(|(k, _)| k.trim().to_string())
                .unwrap_or_else(|| line_text.trim().to_string());
            (line, column, key)
        }
        None => (0, 0, String::from("?")),
    };
    ProfileError::Invalid {
        file: file.to_path_buf(),
        line,
        column,
        key,
        reason: e.message().trim().to_string(),
    }
}

pub fn to_toml(p: &Profile) -> String {
    toml::to_string_pretty(p).expect("profiles always serialize")
}

/// A profile file's name and what reading it gave.
pub type Listed = (String, Result<Profile, ProfileError>);

/// Profiles in one directory.
pub struct Store {
    pub dir: PathBuf,
}

impl Store {
    pub fn new(dir: PathBuf) -> Self {
        Store { dir }
    }

    pub fn path(&self, name: &str) -> Result<PathBuf, ProfileError> {
        check_name(name)?;
        Ok(self.dir.join(format!("{name}.toml")))
    }

    pub fn load(&self, name: &str) -> Result<Profile, ProfileError> {
        let path = self.path(name)?;
        if !path.is_file() {
            return Err(ProfileError::NotFound {
                name: name.to_string(),
                dir: self.dir.clone(),
            });
        }
        load_file(&path)
    }

    /// Names and parse results of every `*.toml` in the directory.
    pub fn list(&self) -> Result<Vec<Listed>, ProfileError> {
        let rd = match std::fs::read_dir(&self.dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io(&self.dir)(e)),
        };
        let mut v: Vec<_> = rd
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .filter_map(|p| {
                let name = p.file_stem()?.to_string_lossy().into_owned();
                Some((name, load_file(&p)))
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(v)
    }

    /// Writes atomically: a crash leaves either the old or the new profile.
    /// An API key held in memory is not written; a profile that would not
    /// load without it (a public bind with no key file) is refused.
    pub fn save(&self, p: &Profile) -> Result<PathBuf, ProfileError> {
        let path = self.path(&p.name)?;
        let text = to_toml(p);
        if let Err(e) = parse(&text, &path) {
            let reason = match e {
                ProfileError::Rejected { reason, .. } if p.options.api_key.is_some() => format!(
                    "{reason}; the API key given for this run is never stored in a profile: save it in a file only you can read (chmod 600) and set the profile's API key file"
                ),
                other => other.to_string(),
            };
            return Err(ProfileError::Rejected { file: path, reason });
        }
        self.write_atomic(&p.name, &path, &text)
    }

    /// Saves profile text as written (comments kept) under `name`, after
    /// checking that it parses and that its `name` is `name`.
    pub fn save_text(&self, name: &str, text: &str) -> Result<PathBuf, ProfileError> {
        let path = self.path(name)?;
        let p = parse(text, &path)?;
        if p.name != name {
            return Err(ProfileError::Rejected {
                file: path,
                reason: format!("its name is '{}', not '{name}'", p.name),
            });
        }
        self.write_atomic(name, &path, text)
    }

    /// A crash leaves either the old file or the new one, never half of one.
    fn write_atomic(&self, name: &str, path: &Path, text: &str) -> Result<PathBuf, ProfileError> {
        std::fs::create_dir_all(&self.dir).map_err(io(&self.dir))?;
        let tmp = self
            .dir
            .join(format!(".{name}.toml.tmp-{}", std::process::id()));
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io(path)(e)
        })?;
        Ok(path.to_path_buf())
    }

    pub fn delete(&self, name: &str) -> Result<PathBuf, ProfileError> {
        let path = self.path(name)?;
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(ProfileError::NotFound {
                name: name.to_string(),
                dir: self.dir.clone(),
            }),
            Err(e) => Err(io(&path)(e)),
        }
    }
}

pub fn load_file(path: &Path) -> Result<Profile, ProfileError> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    parse(&text, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Profile {
        Profile {
            schema: SCHEMA,
            name: "a3b".into(),
            description: Some("test".into()),
            options: LaunchOptions {
                model: "/models/a3b".into(),
                context_length: Some(32768),
                vram_limit_bytes: Some(20 << 30),
                ..Default::default()
            },
        }
    }

    #[test]
    fn save_list_load_delete() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::new(t.path().join("profiles"));
        assert!(s.list().unwrap().is_empty());
        let path = s.save(&sample()).unwrap();
        assert!(path.ends_with("a3b.toml"));
        assert_eq!(s.load("a3b").unwrap(), sample());
        let listed = s.list().unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].0, "a3b");
        // No temp file is left behind.
        assert_eq!(std::fs::read_dir(&s.dir).unwrap().count(), 1);
        s.delete("a3b").unwrap();
        assert!(matches!(s.load("a3b"), Err(ProfileError::NotFound { .. })));
        assert!(matches!(
            s.delete("a3b"),
            Err(ProfileError::NotFound { .. })
        ));
    }

    #[test]
    fn bad_names_never_touch_other_paths() {
        for n in ["../x", "a/b", "", ".hidden", "a b"] {
            assert!(
                matches!(check_name(n), Err(ProfileError::BadName(_))),
                "{n}"
            );
        }
    }

    #[test]
    fn unknown_key_reports_file_line_and_key() {
        let text = "schema = 1\nname = \"x\"\n\n[options]\nmodel = \"/m\"\ncontext_lenght = 4096\n";
        let e = parse(text, Path::new("x.toml")).unwrap_err();
        match &e {
            ProfileError::Invalid {
                line, key, reason, ..
            } => {
                assert_eq!(*line, 6, "{e}");
                assert_eq!(key, "context_lenght");
                assert!(reason.contains("unknown field"), "{reason}");
            }
            other => panic!("wrong error: {other}"),
        }
        assert!(e.to_string().starts_with("x.toml:6:"));
    }

    #[test]
    fn wrong_type_and_bad_values_are_located() {
        let text = "schema = 1\nname = \"x\"\n[options]\nmodel = \"/m\"\nport = \"eighty\"\n";
        let e = parse(text, Path::new("x.toml")).unwrap_err().to_string();
        assert!(e.contains(":5:") && e.contains("'port'"), "{e}");
        let text = "schema = 1\nname = \"x\"\n[options]\nmodel = \"/m\"\nhost = \"0.0.0.0\"\n";
        let e = parse(text, Path::new("x.toml")).unwrap_err().to_string();
        assert!(e.contains("options.host"), "{e}");
    }

    #[test]
    fn schema_is_required_and_versioned() {
        let e = parse("name = \"x\"\n[options]\n", Path::new("x.toml")).unwrap_err();
        assert!(e.to_string().contains("schema = 1"));
        let e = parse("schema = 2\nname = \"x\"\n[options]\n", Path::new("x.toml")).unwrap_err();
        assert!(e.to_string().contains("schema 2"));
    }

    #[test]
    fn keys_are_never_saved_and_never_read() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::new(t.path().to_path_buf());
        let mut p = sample();
        p.options.api_key = Some("typed-in-the-tui-0123".into());
        let path = s.save(&p).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains("typed-in-the-tui"), "{text}");
        assert_eq!(s.load("a3b").unwrap().options.api_key, None);
        // A public profile whose only key is in memory would not load: refused.
        p.options.host = "0.0.0.0".into();
        let e = s.save(&p).unwrap_err().to_string();
        assert!(e.contains("never stored in a profile"), "{e}");
        p.options.api_key = None;
        p.options.api_key_file = Some("/etc/krasis/key".into());
        s.save(&p).unwrap();
        let back = s.load("a3b").unwrap();
        assert_eq!(back.options.api_key_file, p.options.api_key_file);
        // A key written into a profile by hand is refused, not used.
        let text = "schema = 1\nname = \"x\"\n[options]\nmodel = \"/m\"\napi_key = \"change-me\"\n";
        let e = parse(text, Path::new("x.toml")).unwrap_err().to_string();
        assert!(e.contains("api_key_file"), "{e}");
    }

    #[test]
    fn cors_origins_are_a_profile_field() {
        let text = "schema = 1\nname = \"x\"\n[options]\nmodel = \"/m\"\ncors_origins = [\"https://chat.example\"]\n";
        let p = parse(text, Path::new("x.toml")).unwrap();
        assert_eq!(p.options.cors_origins, vec!["https://chat.example"]);
        let text = "schema = 1\nname = \"x\"\n[options]\nmodel = \"/m\"\ncors_origins = [\"chat.example\"]\n";
        let e = parse(text, Path::new("x.toml")).unwrap_err().to_string();
        assert!(e.contains("options.cors_origins"), "{e}");
    }

    #[test]
    fn shipped_examples_load_and_validate() {
        assert!(
            examples::EXAMPLES.len() >= 2,
            "expected shipped example profiles"
        );
        for e in examples::EXAMPLES {
            let name = e.name;
            let p = e
                .profile()
                .unwrap_or_else(|e| panic!("profiles/{name}.toml: {e}"));
            assert_eq!(p.name, name);
            let caps = crate::runtime::tests::fake_caps(true);
            caps.check_options(&p.options, "qwen3_moe")
                .unwrap_or_else(|e| panic!("profiles/{name}.toml: {e}"));
            assert_eq!(p.options.api_key, None, "profiles/{name}.toml ships a key");
        }
    }
}
