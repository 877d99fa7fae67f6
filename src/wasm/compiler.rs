//! Compiling untrusted code within bounds: a size limit, and compilation in a child process
//! with an address-space limit, a CPU-time limit and a wall-clock timeout.
//!
//! ```text
//! .wasm bytes ─ larger than MAX_MODULE_BYTES? ─▶ refused
//!             ─ refused before (same SHA-256)? ─▶ refused again, not compiled
//!             ─▶ `wasm-provisioner compile-guest` (RLIMIT_AS, RLIMIT_CPU, SCHED_BATCH and nice
//!                  10, one compiler thread; killed at the timeout)
//!                  stdin: the component, stdout: wasmtime's artifact ─▶ deserialized here
//! ```
//!
//! Why: a small module with huge function bodies (a "compile bomb": 613 KiB, ~10 s and 1.8 GiB
//! to compile) took the whole process down at load, and a hot-reload rescan compiled a refused
//! bomb again every time. In a child, only the child dies, and it is the OOM killer's first
//! choice (`oom_score_adj` 1000) when the container's memory runs out while it compiles. It
//! runs at `SCHED_BATCH`, nice 10, with wasmtime's parallel compilation
//! off: it takes at most one CPU, and only CPU time nothing else wants. `run` compiles in the
//! background, one module at a time ([`super::compile_queue`]); `inspect` and the other offline
//! commands compile in the same child under the same limits.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use wasmtime::{Config, Engine};

/// Largest `.wasm` the host reads (guests are a few hundred KiB).
pub const MAX_MODULE_BYTES: usize = 32 << 20;

/// Largest compiled artifact the controller takes from the child: the child may use more
/// address space than the controller's container has, and what it returns is held whole.
pub const MAX_ARTIFACT_BYTES: usize = 4 * MAX_MODULE_BYTES;

/// The child's limits.
#[derive(Debug, Clone)]
pub struct CompileLimits {
    /// The executable that has the `compile-guest` command (this binary).
    pub program: PathBuf,
    /// Address space of the child (`RLIMIT_AS`), MiB.
    pub memory_mib: u64,
    /// CPU time of the child (`RLIMIT_CPU`), seconds.
    pub cpu_seconds: u64,
    /// Wall-clock time before the child is killed.
    pub timeout: Duration,
}

impl CompileLimits {
    /// This executable, 1 GiB of address space, 60 CPU seconds, 120 s.
    pub fn for_this_binary() -> std::io::Result<CompileLimits> {
        Ok(CompileLimits {
            program: std::env::current_exe()?,
            memory_mib: 1024,
            cpu_seconds: 60,
            timeout: Duration::from_secs(120),
        })
    }

    /// What a refusal under these limits depends on, for its record: other limits (or another
    /// version of this binary) compile the module again.
    pub fn key(&self) -> String {
        format!(
            "child-{}-as{}-cpu{}-t{}",
            env!("CARGO_PKG_VERSION"),
            self.memory_mib,
            self.cpu_seconds,
            self.timeout.as_secs()
        )
    }
}

/// Why the child produced no artifact.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    /// The child could not be run.
    #[error("cannot run the compiler process {program}: {source}")]
    Spawn {
        /// The executable.
        program: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The child ran past its wall-clock timeout and was killed.
    #[error("compiling took longer than {0:?}; the compiler process was killed")]
    Timeout(Duration),
    /// The child failed: its limits, or the module.
    #[error("{0}")]
    Failed(String),
}

impl CompileError {
    /// Whether the same bytes under the same limits would fail again: not when the child could
    /// not be run, nor when it ran out of wall-clock time (a busy node slows it, and at
    /// low priority it gets little CPU). Only such refusals are recorded on disk.
    pub fn is_lasting(&self) -> bool {
        matches!(self, CompileError::Failed(_))
    }
}

/// Compiles `bytes` in a child under `limits`; wasmtime's serialized artifact.
pub fn compile_in_child(limits: &CompileLimits, bytes: &[u8]) -> Result<Vec<u8>, CompileError> {
    let mut command = Command::new(&limits.program);
    first_to_go_and_last_to_run(&mut command);
    let mut child = command
        .arg("compile-guest")
        .arg("--memory-mib")
        .arg(limits.memory_mib.to_string())
        .arg("--cpu-seconds")
        .arg(limits.cpu_seconds.to_string())
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| CompileError::Spawn {
            program: limits.program.display().to_string(),
            source,
        })?;
    // Feed and drain on threads of their own, so neither pipe can fill up and stall us.
    let mut stdin = child.stdin.take().expect("piped");
    let input = bytes.to_vec();
    let feeder = std::thread::spawn(move || stdin.write_all(&input));
    let mut stdout = child.stdout.take().expect("piped");
    let reader = std::thread::spawn(move || read_capped(&mut stdout, MAX_ARTIFACT_BYTES));
    let mut stderr = child.stderr.take().expect("piped");
    let errors = std::thread::spawn(move || {
        let mut text = Vec::new();
        // The child's message is short; never keep more than 4 KiB of it.
        let _ = (&mut stderr).take(4096).read_to_end(&mut text);
        String::from_utf8_lossy(&text).into_owned()
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child
            .try_wait()
            .map_err(|e| CompileError::Failed(e.to_string()))?
        {
            break status;
        }
        if started.elapsed() >= limits.timeout {
            let _ = child.kill();
            let _ = child.wait();
            return Err(CompileError::Timeout(limits.timeout));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let _ = feeder.join();
    let artifact = match reader.join() {
        Ok(Ok(Some(artifact))) => artifact,
        Ok(Ok(None)) => {
            return Err(CompileError::Failed(format!(
                "the compiled artifact is larger than {} MiB",
                MAX_ARTIFACT_BYTES >> 20
            )));
        }
        // A broken pipe or a panicked reader: the status and the child's message say why.
        Ok(Err(_)) | Err(_) => Vec::new(),
    };
    let message = errors.join().unwrap_or_default();
    if status.success() && !artifact.is_empty() {
        return Ok(artifact);
    }
    let why = match status.code() {
        Some(_) => message.trim().to_string(),
        None => format!(
            "the compiler process was killed ({status}), past its limits of {} MiB of address space or {} CPU seconds",
            limits.memory_mib, limits.cpu_seconds
        ),
    };
    Err(CompileError::Failed(why))
}

/// Everything `from` yields if it is at most `cap` bytes; `None` past that, after draining the
/// rest unkept (so the writer can finish instead of blocking on a full pipe).
fn read_capped(from: &mut impl Read, cap: usize) -> std::io::Result<Option<Vec<u8>>> {
    let mut kept = Vec::new();
    from.take(cap as u64 + 1).read_to_end(&mut kept)?;
    if kept.len() <= cap {
        return Ok(Some(kept));
    }
    drop(kept);
    std::io::copy(from, &mut std::io::sink())?;
    Ok(None)
}

/// Compiles component `bytes` as the host's engine would ([`base_config`]), to wasmtime's
/// artifact (the `compile-guest` child's work). On one thread: the child takes at most one CPU
/// (how functions are compiled is no part of the artifact's compatibility, so the parent's
/// engine loads it).
pub fn precompile(bytes: &[u8]) -> wasmtime::Result<Vec<u8>> {
    let mut config = base_config();
    config.parallel_compilation(false);
    Engine::new(&config)?.precompile_component(bytes)
}

/// The settings of every engine of this host, the child's too: an artifact loads only into an
/// engine configured alike (wasmtime refuses it otherwise).
pub fn base_config() -> Config {
    let mut config = Config::new();
    config.epoch_interruption(true);
    config.wasm_component_model(true);
    // Guests recursing without bound hit this, not the host's stack.
    config.max_wasm_stack(1 << 20);
    config
}

/// Makes the child the kernel's OOM killer's first choice (`oom_score_adj` 1000) from its first
/// instruction. Compiling shares the container's memory limit with the controller, and RLIMIT_AS
/// caps the child's address space, not what the cgroup has left: when the two together reach the
/// limit, the kernel must take the child, never the controller (it picks the largest process by
/// default, which is the controller). Set before `exec`, not by the child itself: its start-up
/// (loading, the runtime, parsing its arguments) allocates before its first line runs, and an
/// OOM in that window would go by size. Raising a score needs no privilege.
///
/// The child also yields the CPU to the controller: `SCHED_BATCH` at nice 10, about a tenth of a
/// CPU the controller wants too. Not `SCHED_IDLE`: on a saturated node that starved the compile
/// for minutes, and a guest with nothing else serving its claims never loaded (seen when a 200-
/// claim kill loop ran beside other tests). Lowering one's own priority needs no privilege;
/// neither call failing stops the compile.
fn first_to_go_and_last_to_run(command: &mut Command) {
    use rustix::fs::{Mode, OFlags};
    use std::os::unix::process::CommandExt;
    #[expect(
        unsafe_code,
        reason = "Command::pre_exec runs its closure in the forked child before exec, where only \
                  async-signal-safe work is sound; the closure makes system calls only"
    )]
    // SAFETY: the closure runs between fork and exec, where only async-signal-safe work is
    // allowed: rustix's open of a static C string and write of a static buffer, setpriority
    // and sched_setscheduler are system calls that allocate nothing and take no lock.
    unsafe {
        command.pre_exec(|| {
            let fd = rustix::fs::open(
                c"/proc/self/oom_score_adj",
                OFlags::WRONLY | OFlags::CLOEXEC,
                Mode::empty(),
            )?;
            rustix::io::write(&fd, b"1000")?;
            let batch = libc::sched_param { sched_priority: 0 };
            // SAFETY (as above): one system call on a stack value.
            let _ = libc::sched_setscheduler(0, libc::SCHED_BATCH, &batch);
            let _ = rustix::process::setpriority_process(None, 10);
            Ok(())
        });
    }
}

/// The child's side (`wasm-provisioner compile-guest`): limits itself, reads the component
/// from stdin, writes the artifact to stdout.
pub fn run_child(memory_mib: u64, cpu_seconds: u64) -> anyhow::Result<()> {
    use rustix::process::{Resource, Rlimit, setrlimit};
    // The parent made this process the OOM killer's first choice before exec.
    let bytes = memory_mib.saturating_mul(1 << 20);
    setrlimit(
        Resource::As,
        Rlimit {
            current: Some(bytes),
            maximum: Some(bytes),
        },
    )?;
    setrlimit(
        Resource::Cpu,
        Rlimit {
            current: Some(cpu_seconds),
            maximum: Some(cpu_seconds),
        },
    )?;
    let mut input = Vec::new();
    std::io::stdin()
        .take(MAX_MODULE_BYTES as u64 + 1)
        .read_to_end(&mut input)?;
    anyhow::ensure!(
        input.len() <= MAX_MODULE_BYTES,
        "larger than {MAX_MODULE_BYTES} bytes"
    );
    let artifact = precompile(&input).map_err(|e| anyhow::anyhow!("{e:#}"))?;
    std::io::stdout().write_all(&artifact)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_artifact_past_the_cap_is_refused_and_drained() {
        let cases: &[(usize, usize, bool)] = &[
            // (bytes written, cap, kept)
            (0, 10, true),
            (10, 10, true),
            (11, 10, false),
            (1 << 20, 4096, false),
        ];
        for &(len, cap, kept) in cases {
            let mut from = std::io::Cursor::new(vec![7u8; len]);
            let read = read_capped(&mut from, cap).expect("read");
            assert_eq!(read.is_some(), kept, "{len} bytes, cap {cap}");
            if let Some(artifact) = read {
                assert_eq!(artifact.len(), len);
            }
            assert_eq!(
                from.position() as usize,
                len,
                "drained: {len} bytes, cap {cap}"
            );
        }
    }
}
