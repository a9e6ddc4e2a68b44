//! The one validation every entry point goes through: TUI, `krasis serve`,
//! `--profile`, `profiles save`. Option-level checks (`LaunchOptions::validate`),
//! capability checks against what the runtime implements
//! (`Capabilities::check_options`), and checks against the model itself.

use crate::probe::{ModelSummary, models};
use crate::runtime::RuntimeFacts;
use krasis_common::{Capabilities, LaunchOptions, OptionError};

/// Validates `opts` for a model whose facts are already known.
pub fn validate_with_model(
    opts: &LaunchOptions,
    caps: &Capabilities,
    model: &ModelSummary,
) -> Result<(), OptionError> {
    opts.validate()?;
    check_key_file(opts)?;
    caps.check_options(opts, &model.model_type)?;
    if let Some(c) = opts.context_length
        && c as usize > model.max_position_embeddings
    {
        return Err(OptionError::new(
            "context_length",
            format!(
                "{c} exceeds the model's maximum of {} tokens (max_position_embeddings)",
                model.max_position_embeddings
            ),
        ));
    }
    Ok(())
}

/// Reads the API key file now, so a missing, empty, shared or weak key is
/// refused before the runtime starts (the runtime reads it again itself).
fn check_key_file(opts: &LaunchOptions) -> Result<(), OptionError> {
    if opts.api_key_file.is_none() {
        return Ok(());
    }
    let key = opts.resolved_api_key()?;
    LaunchOptions {
        api_key: key,
        api_key_file: None,
        ..opts.clone()
    }
    .validate()
    .map_err(|e| OptionError::new("api_key_file", e.reason))
}

/// Asks the runtime about the model named in `opts`, then
/// [`validate_with_model`].
pub fn validate(
    opts: &LaunchOptions,
    caps: &Capabilities,
    facts: &dyn RuntimeFacts,
) -> Result<ModelSummary, OptionError> {
    opts.validate()?;
    let dir = &opts.model;
    if !dir.is_dir() {
        return Err(OptionError::new(
            "model",
            format!(
                "{} is not a directory; give a Hugging Face model directory",
                dir.display()
            ),
        ));
    }
    if !models::is_model_dir(dir) {
        return Err(OptionError::new(
            "model",
            format!(
                "{} has no config.json with *.safetensors next to it; give a Hugging Face model directory",
                dir.display()
            ),
        ));
    }
    let summary = models::inspect_one(facts, dir, opts.cache_dir.as_deref())
        .map_err(|e| OptionError::new("model", e))?;
    validate_with_model(opts, caps, &summary)?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::fake::{FakeFacts, a3b};
    use crate::runtime::tests::fake_caps;

    #[test]
    fn context_beyond_the_model_is_refused() {
        let caps = fake_caps(false);
        let mut o = caps.default_options("qwen3_moe").unwrap();
        o.model = "/m".into();
        validate_with_model(&o, &caps, &a3b()).unwrap();
        o.context_length = Some(1 << 20);
        let e = validate_with_model(&o, &caps, &a3b()).unwrap_err();
        assert_eq!(e.option, "context_length");
        assert!(e.reason.contains("40960"));
    }

    #[test]
    fn the_key_file_is_read_and_checked_before_launch() {
        let caps = fake_caps(false);
        let mut o = caps.default_options("qwen3_moe").unwrap();
        o.model = "/m".into();
        o.host = "0.0.0.0".into();
        let t = tempfile::tempdir().unwrap();
        let key = t.path().join("key");
        o.api_key_file = Some(key.clone());
        let e = validate_with_model(&o, &caps, &a3b()).unwrap_err();
        assert!(e.reason.contains("cannot read"), "{e}");
        let write = |text: &str| {
            std::fs::write(&key, text).unwrap();
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
            }
        };
        write("change-me\n");
        let e = validate_with_model(&o, &caps, &a3b()).unwrap_err();
        assert_eq!(e.option, "api_key_file");
        assert!(e.reason.contains("placeholder"), "{e}");
        write("0123456789abcdef0123\n");
        validate_with_model(&o, &caps, &a3b()).unwrap();
    }

    #[test]
    fn missing_model_dir_says_what_to_do() {
        let caps = fake_caps(false);
        let mut o = caps.default_options("qwen3_moe").unwrap();
        let t = tempfile::tempdir().unwrap();
        o.model = t.path().join("nope");
        assert!(
            validate(&o, &caps, &FakeFacts::default())
                .unwrap_err()
                .reason
                .contains("not a directory")
        );
        o.model = t.path().to_path_buf();
        assert!(
            validate(&o, &caps, &FakeFacts::default())
                .unwrap_err()
                .reason
                .contains("config.json")
        );
    }
}
