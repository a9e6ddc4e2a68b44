//! `krasis probe` and `krasis profiles`: the commands that report and manage
//! rather than serve.

use super::{Ctx, resolve_model_name, resolve_options};
use crate::cli::ProfilesCmd;
use crate::probe::{Probe, report, report_text};
use crate::profiles::{self, Listed, Profile, examples};
use crate::runtime;
use anyhow::bail;
use std::path::PathBuf;
use std::process::ExitCode;

pub fn probe_cmd(ctx: &Ctx, json: bool, cache_dir: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    let mut p = ctx.probe();
    p.cache_root = cache_dir;
    let hw = p.hardware();
    let found = p.models();
    let runtime = match ctx.runtime() {
        Ok(rt) => match runtime::capabilities(&rt) {
            Ok(c) => Ok((rt, c)),
            Err(e) => Err((Some(rt), e.to_string())),
        },
        Err(e) => Err((None, e.to_string())),
    };
    let r = report::build(&hw, &p.roots, &found, &runtime);
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", report_text::render(&r));
    }
    Ok(ExitCode::SUCCESS)
}

/// One line of `profiles list`: name, model, backend, description.
fn row(name: &str, p: &Result<Profile, profiles::ProfileError>) -> Vec<String> {
    match p {
        Ok(p) => vec![
            name.to_string(),
            p.options.model.display().to_string(),
            format!("[{}]", p.options.backend.as_str()),
            p.description.clone().unwrap_or_default(),
        ],
        Err(e) => vec![name.to_string(), format!("INVALID: {e}")],
    }
}

fn print_rows(rows: &[Vec<String>]) {
    let mut out = String::new();
    report_text::table(&mut out, "  ", rows);
    print!("{out}");
}

fn list(ctx: &Ctx) -> anyhow::Result<()> {
    let store = ctx.store();
    let mine: Vec<Listed> = store.list()?;
    println!("Your profiles, in {}:", store.dir.display());
    if mine.is_empty() {
        println!(
            "  none yet: copy an example below, or save one with `krasis profiles save NAME --model DIR ...`"
        );
    }
    let rows: Vec<Vec<String>> = mine.iter().map(|(n, p)| row(n, p)).collect();
    print_rows(&rows);
    println!();
    println!("Shipped examples (built into krasis):");
    let rows: Vec<Vec<String>> = examples::EXAMPLES
        .iter()
        .map(|e| {
            let mut r = row(e.name, &e.profile());
            if mine.iter().any(|(n, _)| n == e.name) {
                r.push("(your profile of this name is used instead)".into());
            }
            r
        })
        .collect();
    print_rows(&rows);
    println!();
    println!("Serve one with `krasis serve --profile NAME` (yours first, then the examples).");
    println!(
        "To change an example, copy it into your profiles and edit the copy: `krasis profiles copy EXAMPLE [NEW-NAME]`."
    );
    Ok(())
}

pub fn profiles_cmd(ctx: &Ctx, cmd: &ProfilesCmd) -> anyhow::Result<ExitCode> {
    let store = ctx.store();
    match cmd {
        ProfilesCmd::List => list(ctx)?,
        ProfilesCmd::Show { name } => match store.load(name) {
            Err(profiles::ProfileError::NotFound { .. }) if examples::find(name).is_some() => {
                // As shipped, comments included, so it can be read or redirected to a file.
                print!("{}", examples::find(name).map_or("", |e| e.text));
            }
            p => print!("{}", profiles::to_toml(&p?)),
        },
        ProfilesCmd::Copy {
            example,
            name,
            force,
        } => {
            let to = name.as_deref().unwrap_or(example);
            let path = examples::copy(&store, example, to, *force)?;
            println!("copied example '{example}' to {}", path.display());
            println!("edit it there; serve it with `krasis serve --profile {to}`");
        }
        ProfilesCmd::Save {
            name,
            description,
            force,
            opts,
        } => {
            profiles::check_name(name)?;
            if !force && store.path(name)?.exists() {
                bail!("profile '{name}' already exists; pass --force to replace it");
            }
            let (rt, caps) = ctx.caps()?;
            let mut flags = (**opts).clone();
            if let Some(m) = &mut flags.model {
                resolve_model_name(ctx, &rt, m)?;
            }
            let (options, _) = resolve_options(&caps, &*ctx.facts(), None, &flags)?;
            let path = store.save(&Profile {
                schema: profiles::SCHEMA,
                name: name.clone(),
                description: description.clone(),
                options,
            })?;
            println!("saved {}", path.display());
        }
        ProfilesCmd::Delete { name } => {
            let path = store.delete(name)?;
            println!("deleted {}", path.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}
