//! The `wasm-provisioner` binary: parse the command line, start logging, run one command.

use clap::Parser;
use wasm_provisioner::config::{Cli, Command, Scaffold};
use wasm_provisioner::config::{ForgetArgs, ReleaseArgs};
use wasm_provisioner::oci::commands as oci;
use wasm_provisioner::{fixtures, offline, run, scaffold, telemetry, uninstall};

fn main() -> std::process::ExitCode {
    wasm_provisioner::malloc::limit_arenas();
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime.block_on(run_command()),
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run_command() -> std::process::ExitCode {
    let cli = Cli::parse();
    telemetry::init(cli.log_format);
    let result = match cli.command {
        Command::Run(args) => run::run(*args).await.map(|()| String::new()),
        Command::Inspect { file, compile } => offline::inspect(&file, compile.limits()),
        Command::Provision(args) => {
            offline::provision(
                &args.plugins,
                &args.class,
                &args.claim,
                args.node.as_deref(),
                args.compile.limits(),
            )
            .await
        }
        Command::Delete(args) => {
            offline::delete(
                &args.plugins,
                &args.volume,
                args.class.as_deref(),
                args.compile.limits(),
            )
            .await
        }
        Command::Scaffold(Scaffold::Grant {
            file,
            host_dirs,
            provisioner,
        }) => scaffold::grant_for_file(&file, &host_dirs, provisioner.as_deref()),
        Command::Scaffold(Scaffold::Guest { name, sdk, dir }) => {
            scaffold::guest(&name, &sdk, dir.as_deref())
        }
        Command::Test {
            module,
            grant,
            fixtures,
            record,
            compile,
        } => fixtures::run(&module, &grant, &fixtures, record, compile.limits())
            .await
            .and_then(|report| match report.failed {
                0 => Ok(report.text),
                _ => Err(anyhow::anyhow!("{}", report.text)),
            }),
        Command::ReleaseFinalizers(args) => release(args).await,
        Command::ForgetStorage(args) => forget(args).await,
        Command::Push(args) => oci::push(args).await.map_err(Into::into),
        Command::Pull(args) => oci::pull(args).await.map_err(Into::into),
        Command::Save(args) => oci::save(args).await.map_err(Into::into),
        Command::Load(args) => oci::load(args).map_err(Into::into),
        Command::CompileGuest {
            memory_mib,
            cpu_seconds,
        } => wasm_provisioner::wasm::compiler::run_child(memory_mib, cpu_seconds)
            .map(|()| String::new()),
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

async fn release(args: ReleaseArgs) -> anyhow::Result<String> {
    let target = match &args.claim {
        Some(claim) => uninstall::parse_claim(claim).map_err(anyhow::Error::msg)?,
        None => uninstall::Target::All,
    };
    let client = run::client(args.cluster.kubeconfig.as_deref()).await?;
    let provisioners = args.provisioners.into_iter().collect();
    let mut report =
        uninstall::release_finalizers(client.clone(), target, &provisioners, args.dry_run).await?;
    match uninstall::report_intents(&client, &args.cluster.namespace).await {
        Ok(pending) if pending.is_empty() => {}
        Ok(pending) => {
            report.push_str("storage the intent logs still name (see `forget-storage`):\n");
            report.push_str(&pending);
        }
        Err(error) => report.push_str(&format!("intent logs not read: {error:#}\n")),
    }
    Ok(report)
}

async fn forget(args: ForgetArgs) -> anyhow::Result<String> {
    let client = run::client(args.cluster.kubeconfig.as_deref()).await?;
    uninstall::forget_storage(client, &args.cluster.namespace, &args.pv, args.dry_run).await
}
