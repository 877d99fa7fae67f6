//! One runner for the end-to-end binaries: list and filter like libtest, one control plane for
//! the whole binary, a deadline per test, and the run directory kept when a test fails.

use std::future::Future;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use libtest_mimic::{Arguments, Failed, Trial};
use wp_harness::ControlPlane;

/// What an end-to-end test returns.
pub type TestFuture = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;

/// An end-to-end test: gets the shared control plane, makes its own namespace and processes.
pub type TestFn = fn(Arc<ControlPlane>) -> TestFuture;

/// `(name, TestFn)` pairs from test functions: `e2e_tests![first_test, second_test]`.
#[macro_export]
macro_rules! e2e_tests {
    ($($name:ident),* $(,)?) => {
        vec![$((stringify!($name), (|cp| Box::pin($name(cp))) as $crate::common::suite::TestFn)),*]
    };
}

/// A test made at run time (a name per RBAC variant, say), possibly ignored.
pub struct Test {
    pub name: String,
    pub ignored: bool,
    pub run: Box<dyn FnOnce(Arc<ControlPlane>) -> TestFuture + Send>,
}

impl Test {
    pub fn new(
        name: impl Into<String>,
        run: impl FnOnce(Arc<ControlPlane>) -> TestFuture + Send + 'static,
    ) -> Test {
        Test {
            name: name.into(),
            ignored: false,
            run: Box::new(run),
        }
    }

    pub fn ignored_if(mut self, ignored: bool) -> Test {
        self.ignored = ignored;
        self
    }
}

/// How a suite runs: what it is called in messages, the guests it builds first, the deadline of
/// one test, and whether its tests must run one at a time.
pub struct Suite {
    pub what: &'static str,
    pub guests: &'static [&'static str],
    pub timeout: Duration,
    pub one_at_a_time: bool,
}

/// Runs `tests` of the suite `what` against one control plane, after building `guests`.
pub fn run(
    what: &'static str,
    guests: &'static [&'static str],
    timeout: Duration,
    tests: Vec<(&'static str, TestFn)>,
) -> ExitCode {
    let suite = Suite {
        what,
        guests,
        timeout,
        one_at_a_time: false,
    };
    let tests = tests
        .into_iter()
        .map(|(name, test)| Test::new(name, test))
        .collect();
    run_suite(suite, tests)
}

/// [`run`] for tests made at run time and suites with their own settings.
pub fn run_suite(suite: Suite, tests: Vec<Test>) -> ExitCode {
    let mut args = Arguments::from_args();
    if suite.one_at_a_time {
        args.test_threads = Some(1);
    }
    let selected = tests
        .iter()
        .any(|t| !t.ignored && args.filter.as_deref().is_none_or(|f| t.name.contains(f)));
    if args.list || !selected {
        // Nothing to run: no control plane to start.
        let trials = tests
            .iter()
            .map(|t| Trial::test(t.name.clone(), || Ok(())).with_ignored_flag(t.ignored))
            .collect();
        return libtest_mimic::run(&args, trials).exit_code();
    }
    for guest in suite.guests {
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
    let timeout = suite.timeout;
    let trials = tests
        .into_iter()
        .map(|test| {
            let cp = cp.clone();
            let run = test.run;
            Trial::test(test.name, move || {
                let runtime =
                    tokio::runtime::Runtime::new().map_err(|e| Failed::from(e.to_string()))?;
                runtime
                    .block_on(async move { tokio::time::timeout(timeout, run(cp)).await })
                    .map_err(|_| Failed::from(format!("timed out after {timeout:?}")))?
                    .map_err(|e| Failed::from(format!("{e:#}")))
            })
            .with_ignored_flag(test.ignored)
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    if conclusion.has_failed() {
        cp.mark_failed();
        eprintln!(
            "some {} tests failed; provisioner and control-plane logs are in {} (kept with WP_KEEP_RUN_DIR=1)",
            suite.what,
            cp.run_dir().display()
        );
    }
    drop(cp);
    conclusion.exit_code()
}
