//! A child process owned by a test: output captured to a file, stopped by PID, killed on drop.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

/// How long [`Process::terminate`] waits after SIGTERM before it sends SIGKILL.
pub const TERMINATE_GRACE: Duration = Duration::from_secs(10);

/// How often a stopping process is checked for exit.
const EXIT_POLL_INTERVAL: Duration = Duration::from_millis(50);

/// A spawned `wasm-provisioner` (or any) child process, killed by PID on drop, with stdout and
/// stderr captured together into one log file.
#[derive(Debug)]
pub struct Process {
    name: String,
    child: Child,
    log_path: PathBuf,
    exit_status: Option<ExitStatus>,
}

impl Process {
    /// Spawns `command` with stdin closed and stdout + stderr appended to `log_path` (created or
    /// truncated).
    pub fn spawn(mut command: Command, log_path: PathBuf) -> anyhow::Result<Process> {
        let name = Path::new(command.get_program())
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_else(|| command.get_program().to_string_lossy().into_owned());
        let log = File::create(&log_path)
            .with_context(|| format!("creating log file {}", log_path.display()))?;
        let log_for_stderr = log
            .try_clone()
            .context("duplicating the log file handle for stderr")?;
        let child = command
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_for_stderr)
            .spawn()
            .with_context(|| format!("spawning {command:?}"))?;
        Ok(Process {
            name,
            child,
            log_path,
            exit_status: None,
        })
    }

    /// The program's file name, for messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The OS process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Where stdout and stderr go.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Everything the process has written so far (lossy UTF-8; empty if unreadable).
    pub fn log(&self) -> String {
        std::fs::read(&self.log_path)
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_default()
    }

    /// The last `lines` lines of [`Process::log`], for error messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// The exit status if the process has exited (reaping it), `None` while it runs.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        if self.exit_status.is_none() {
            self.exit_status = self.child.try_wait().ok().flatten();
        }
        self.exit_status
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.exit_status().is_none()
    }

    /// Sends SIGKILL and reaps the process. Does nothing if it has already exited.
    pub fn kill(&mut self) {
        if self.is_running() {
            // Err only if it exited in between; `wait` below reaps it either way.
            let _ = self.child.kill();
            self.exit_status = self.child.wait().ok();
        }
    }

    /// Sends SIGTERM and waits up to 10 s for the process to exit, then SIGKILLs it.
    ///
    /// Blocks the calling thread; in async code prefer [`Process::terminate_async`].
    pub fn terminate(&mut self) -> anyhow::Result<ExitStatus> {
        self.terminate_within(TERMINATE_GRACE)
    }

    /// Sends SIGTERM and waits up to `grace` for the process to exit, then SIGKILLs it.
    pub fn terminate_within(&mut self, grace: Duration) -> anyhow::Result<ExitStatus> {
        self.send_sigterm();
        let deadline = Instant::now() + grace;
        while self.is_running() && Instant::now() < deadline {
            std::thread::sleep(EXIT_POLL_INTERVAL);
        }
        self.kill();
        self.exit_status
            .with_context(|| format!("{} (pid {}) could not be reaped", self.name, self.pid()))
    }

    /// [`Process::terminate_within`] without blocking the async runtime while waiting.
    pub async fn terminate_async(&mut self, grace: Duration) -> anyhow::Result<ExitStatus> {
        self.send_sigterm();
        let deadline = tokio::time::Instant::now() + grace;
        while self.is_running() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(EXIT_POLL_INTERVAL).await;
        }
        self.kill();
        self.exit_status
            .with_context(|| format!("{} (pid {}) could not be reaped", self.name, self.pid()))
    }

    /// Sends SIGTERM unless the process has already exited, without waiting.
    pub fn send_sigterm(&mut self) {
        if !self.is_running() {
            return;
        }
        let Ok(pid) = libc::pid_t::try_from(self.child.id()) else {
            return;
        };
        // SAFETY: kill(2) takes plain integers and touches no memory of ours. `pid` is our own
        // child that has not been reaped (is_running() just saw it alive and only this struct
        // waits on it), so the PID cannot have been reused by an unrelated process.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(pid, libc::SIGTERM);
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn captures_output_and_terminates_by_pid() {
        let dir = tempfile::tempdir().unwrap();
        let mut command = Command::new("sh");
        command.args(["-c", "echo out; echo err >&2; exec sleep 60"]);
        let mut process = Process::spawn(command, dir.path().join("sh.log")).unwrap();
        assert!(process.is_running());
        let started = Instant::now();
        while !process.log().contains("err") && started.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let status = process.terminate().unwrap();
        assert!(
            !status.success(),
            "sleep killed by SIGTERM exits unsuccessfully"
        );
        assert!(
            started.elapsed() < TERMINATE_GRACE,
            "SIGTERM alone should stop sleep"
        );
        let log = process.log();
        assert!(log.contains("out") && log.contains("err"), "{log}");
    }
}
