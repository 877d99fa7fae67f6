//! One runner for the end-to-end binaries: list and filter like libtest, one control plane for
//! the whole binary, a deadline per test, and the run directory kept when a test fails.

use std::future::Future;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::{Arguments, Failed, Trial};
use wp_harness::ControlPlane;

/// An end-to-end test: gets the shared control plane, makes its own namespace and processes.
pub type TestFn = fn(Arc<ControlPlane>) -> Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;

/// `(name, TestFn)` pairs from test functions: `e2e_tests![first_test, second_test]`.
#[macro_export]
macro_rules! e2e_tests {
    ($($name:ident),* $(,)?) => {
        vec![$((stringify!($name), (|cp| Box::pin($name(cp))) as $crate::common::suite::TestFn)),*]
    };
}

/// Runs `tests` of the suite `what` against one control plane, after building `guests`.
pub fn run(
    what: &str,
    guests: &[&str],
    timeout: Duration,
    tests: Vec<(&'static str, TestFn)>,
) -> ExitCode {
    let args = Arguments::from_args();
    let selected = tests
        .iter()
        .any(|(name, _)| args.filter.as_deref().is_none_or(|f| name.contains(f)));
    if args.list || !selected {
        // Nothing to run: no control plane to start.
        let trials = tests
            .iter()
            .map(|(name, _)| Trial::test(*name, || Ok(())))
            .collect();
        return libtest_mimic::run(&args, trials).exit_code();
    }
    for guest in guests {
        super::guest_wasm(guest);
    }
    let runtime = tokio::runtime::Runtime::new().expect("tokio runtime");
    let cp = match runtime.block_on(ControlPlane::start()) {
        Ok(cp) => Arc::new(cp),
        Err(error) => {
            eprintln!("cannot start the control plane: {error:#}");
            return ExitCode::FAILURE;
        }
    };
    let trials = tests
        .into_iter()
        .map(|(name, test)| {
            let cp = cp.clone();
            Trial::test(name, move || {
                let runtime =
                    tokio::runtime::Runtime::new().map_err(|e| Failed::from(e.to_string()))?;
                runtime
                    .block_on(async move { tokio::time::timeout(timeout, test(cp)).await })
                    .map_err(|_| Failed::from(format!("timed out after {timeout:?}")))?
                    .map_err(|e| Failed::from(format!("{e:#}")))
            })
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    if conclusion.has_failed() {
        cp.mark_failed();
        eprintln!(
            "some {what} tests failed; provisioner and control-plane logs are in {} (kept with WP_KEEP_RUN_DIR=1)",
            cp.run_dir().display()
        );
    }
    drop(cp);
    conclusion.exit_code()
}
