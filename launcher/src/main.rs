//! `krasis`: the launcher. Parses the command line and hands over to the
//! headless commands or the TUI.

use clap::{CommandFactory, Parser};
use krasis::cli::{Cli, Cmd, ServeArgs};
use krasis::headless::{self, Ctx};
use std::io::IsTerminal;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let ctx = Ctx::new(cli.global)?;
    if let Some(name) = cli.profile {
        if cli.command.is_some() {
            anyhow::bail!(
                "--profile NAME before a command is only for serving; use `krasis serve --profile NAME ...`"
            );
        }
        let a = ServeArgs {
            profile: Some(name),
            ..Default::default()
        };
        return headless::serve(&ctx, &a);
    }
    match cli.command {
        None => {
            if std::io::stdin().is_terminal() && std::io::stdout().is_terminal() {
                krasis::tui::run(&ctx)
            } else {
                let _ = Cli::command().print_help();
                eprintln!(
                    "\nnot a terminal: pass a command (e.g. `krasis serve --model DIR` or `krasis demo`)"
                );
                Ok(ExitCode::from(2))
            }
        }
        Some(Cmd::Tui) => krasis::tui::run(&ctx),
        Some(Cmd::Serve(a)) => headless::serve(&ctx, &a),
        Some(Cmd::Demo(a)) => headless::demo(&ctx, &a),
        Some(Cmd::Probe { json, cache_dir }) => headless::probe_cmd(&ctx, json, cache_dir),
        Some(Cmd::Profiles(p)) => headless::profiles_cmd(&ctx, &p),
        Some(Cmd::BuildCache {
            model,
            cache_dir,
            rest,
        }) => headless::build_cache(&ctx, &model, cache_dir.as_deref(), &rest),
        Some(Cmd::Bench { args }) => {
            let mut a = vec!["bench".to_string()];
            a.extend(args);
            headless::forward(&ctx, &a)
        }
        Some(Cmd::Heatmap { args }) => {
            let mut a = vec!["heatmap".to_string()];
            a.extend(args);
            headless::forward(&ctx, &a)
        }
    }
}
