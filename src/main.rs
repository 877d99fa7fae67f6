//! The `wasm-provisioner` binary: parse the command line, start logging, run one command.

use clap::Parser;
use wasm_provisioner::config::{Cli, Command};
use wasm_provisioner::{offline, run, telemetry};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    telemetry::init(cli.log_format);
    let result = match cli.command {
        Command::Run(args) => run::run(*args).await.map(|()| String::new()),
        Command::Inspect { file } => offline::inspect(&file),
        Command::Provision(args) => {
            offline::provision(
                &args.plugins,
                &args.class,
                &args.claim,
                args.node.as_deref(),
            )
            .await
        }
        Command::Delete(args) => {
            offline::delete(&args.plugins, &args.volume, args.class.as_deref()).await
        }
    };
    match result {
        Ok(output) => {
            print!("{output}");
            std::process::ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
