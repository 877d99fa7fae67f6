//! The guarded filesystem's primitives, below the WASI functions it overrides (in
//! `sandbox_fs.rs`): the view a store's filesystem is reached through and the
//! descriptors behind its handles, opening beneath a directory without blocking, and where the
//! work runs (the call's own thread or the blocking pool) so that the call's deadline can end
//! the wait.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use rustix::fs::{FileType, Mode, OFlags};
use wasmtime::component::Resource;
use wasmtime_wasi::FsPerms;
use wasmtime_wasi::filesystem::{Descriptor, WasiFilesystemCtxView};
use wasmtime_wasi::p2::bindings::filesystem::types::{
    DescriptorType, ErrorCode, HostDescriptor, PathFlags,
};
use wasmtime_wasi::p2::{DynInputStream, DynOutputStream, FsError, FsResult};

use super::handles::FsGuard;

/// Where a call's filesystem work runs: on the thread the call runs on, when the call has a
/// thread of its own whose caller enforces the deadline from outside (the guest executor,
/// [`super::executor`]), or else on the blocking pool, where the call's own timeout can end
/// the wait. Either way a system call blocked on a pod's lock outlives the call and is charged
/// to its guest ([`super::handles`]).
#[derive(Debug, Clone, Copy)]
pub enum FsWork {
    /// A round trip to the blocking pool per operation.
    Pool,
    /// On the call's thread; no new operation starts after `deadline` (the call is over: its
    /// caller has given up on it, and the guest traps at its next epoch check).
    Inline {
        /// The call's deadline.
        deadline: std::time::Instant,
    },
}

impl FsWork {
    /// Whether wasmtime-wasi may block the current thread for the call's files too.
    pub fn inline(self) -> bool {
        matches!(self, FsWork::Inline { .. })
    }

    /// Runs `work` and maps its I/O error to the guest's error code.
    pub(super) async fn io(
        self,
        what: &str,
        work: impl FnOnce() -> std::io::Result<()> + Send + 'static,
    ) -> FsResult<()> {
        self.run(what, work)
            .await?
            .map_err(|e| ErrorCode::from(e).into())
    }

    /// Runs `work` where this call's filesystem work runs.
    pub(super) async fn run<R: Send + 'static>(
        self,
        what: &str,
        work: impl FnOnce() -> R + Send + 'static,
    ) -> FsResult<R> {
        match self {
            FsWork::Inline { deadline } if std::time::Instant::now() >= deadline => Err(
                FsError::trap(wasmtime::Error::from(wasmtime::Trap::Interrupt)),
            ),
            FsWork::Inline { .. } => Ok(work()),
            FsWork::Pool => tokio::task::spawn_blocking(work)
                .await
                .map_err(|e| FsError::trap(wasmtime::Error::msg(format!("{what}: {e}")))),
        }
    }
}

/// wasmtime-wasi's filesystem view plus the guard.
pub struct SandboxFsView<'a> {
    pub(super) inner: WasiFilesystemCtxView<'a>,
    pub(super) guard: &'a mut FsGuard,
}

impl<'a> SandboxFsView<'a> {
    /// The view over one store's WASI filesystem state and its guard.
    pub fn new(inner: WasiFilesystemCtxView<'a>, guard: &'a mut FsGuard) -> Self {
        SandboxFsView { inner, guard }
    }

    /// The directory behind a descriptor and its permissions.
    pub(super) fn dir_of(
        &self,
        fd: &Resource<Descriptor>,
    ) -> FsResult<(Arc<std::fs::File>, FsPerms)> {
        match self.inner.table.get(fd)? {
            Descriptor::Dir(dir) => Ok((Arc::clone(&dir.dir), dir.perms)),
            Descriptor::File(_) => Err(ErrorCode::NotDirectory.into()),
        }
    }

    /// The host file behind a descriptor, file or directory, and its permissions.
    pub(super) fn handle_of(
        &self,
        fd: &Resource<Descriptor>,
    ) -> FsResult<(Arc<std::fs::File>, FsPerms)> {
        Ok(match self.inner.table.get(fd)? {
            Descriptor::Dir(dir) => (Arc::clone(&dir.dir), dir.perms),
            Descriptor::File(file) => (Arc::clone(&file.file), file.perms),
        })
    }

    /// The file behind a descriptor (wasmtime-wasi's `bad-descriptor` for a directory).
    pub(super) fn file_of(
        &self,
        fd: &Resource<Descriptor>,
    ) -> FsResult<(Arc<std::fs::File>, FsPerms)> {
        match self.inner.table.get(fd)? {
            Descriptor::File(file) => Ok((Arc::clone(&file.file), file.perms)),
            Descriptor::Dir(_) => Err(ErrorCode::BadDescriptor.into()),
        }
    }

    /// Room for one more stream: each keeps a buffer and, reading or writing in the
    /// background, a pool thread.
    pub(super) fn admit_stream(&mut self) -> FsResult<()> {
        let table = &*self.inner.table;
        let live = |rep| {
            table
                .get(&Resource::<DynInputStream>::new_borrow(rep))
                .is_ok()
                || table
                    .get(&Resource::<DynOutputStream>::new_borrow(rep))
                    .is_ok()
        };
        self.guard.admit_stream(live).map_err(FsError::trap)
    }

    pub(super) fn refuse<T>(&mut self) -> FsResult<T> {
        self.guard.refused += 1;
        Err(ErrorCode::NotPermitted.into())
    }

    /// Whether `path` under the directory `fd` is itself a symlink (not following it).
    pub(super) async fn is_symlink(
        &mut self,
        fd: &Resource<Descriptor>,
        path: &str,
    ) -> FsResult<bool> {
        let stat = HostDescriptor::stat_at(
            &mut self.inner,
            borrow(fd),
            PathFlags::empty(),
            path.to_owned(),
        )
        .await?;
        Ok(stat.type_ == DescriptorType::SymbolicLink)
    }

    /// After a rename or link: if the destination turned out to be a symlink (the source was
    /// swapped for one between our check and the call), remove it and refuse.
    pub(super) async fn undo_if_symlink(
        &mut self,
        fd: &Resource<Descriptor>,
        path: &str,
    ) -> FsResult<()> {
        match self.is_symlink(fd, path).await {
            Ok(false) => Ok(()),
            Ok(true) => {
                HostDescriptor::unlink_file_at(&mut self.inner, borrow(fd), path.to_owned())
                    .await?;
                self.refuse()
            }
            // Gone again already (a racing pod): nothing of ours is a link there.
            Err(_) => Ok(()),
        }
    }
}

/// A borrowed handle to the same resource, for delegating without giving up ours.
pub(super) fn borrow<T: 'static>(resource: &Resource<T>) -> Resource<T> {
    Resource::new_borrow(resource.rep())
}

/// What [`open_beneath`] opened.
pub(super) enum Opened {
    Dir(std::fs::File),
    File(std::fs::File),
}

/// Opens `path` beneath the directory `dir` without blocking: `O_NONBLOCK` so a FIFO cannot
/// hold the thread, then anything that is neither a regular file nor a directory is closed
/// and refused. Escapes (`..` above `dir`, absolute paths or links) fail as cap-std's do.
pub(super) fn open_beneath(
    dir: &std::fs::File,
    path: &std::path::Path,
    flags: OFlags,
    want_dir: bool,
) -> Result<Opened, ErrorCode> {
    use rustix::fs::ResolveFlags;
    // openat2 refuses a mode without O_CREAT (EINVAL), unlike openat.
    let mode = if flags.contains(OFlags::CREATE) {
        Mode::from_raw_mode(0o666)
    } else {
        Mode::empty()
    };
    let flags = flags | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY;
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
    let fd: OwnedFd = match rustix::fs::openat2(dir.as_fd(), path, flags, mode, resolve) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::XDEV) => return Err(ErrorCode::NotPermitted),
        Err(rustix::io::Errno::NOSYS) => return Err(ErrorCode::Unsupported),
        Err(errno) => return Err(std::io::Error::from(errno).into()),
    };
    let stat = rustix::fs::fstat(&fd).map_err(|e| ErrorCode::from(std::io::Error::from(e)))?;
    match FileType::from_raw_mode(stat.st_mode) {
        FileType::Directory => Ok(Opened::Dir(fd.into())),
        _ if want_dir => Err(ErrorCode::NotDirectory),
        FileType::RegularFile => {
            // Regular files ignore O_NONBLOCK on local filesystems; clear it anyway so reads
            // and writes behave as the guest expects on every filesystem.
            let fl = rustix::fs::fcntl_getfl(&fd)
                .map_err(|e| ErrorCode::from(std::io::Error::from(e)))?;
            rustix::fs::fcntl_setfl(&fd, fl - OFlags::NONBLOCK)
                .map_err(|e| ErrorCode::from(std::io::Error::from(e)))?;
            Ok(Opened::File(fd.into()))
        }
        // FIFO, socket, character or block device: a host thread must never wait on one.
        _ => Err(ErrorCode::Access),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[tokio::test]
    async fn inline_work_runs_on_the_calls_thread_and_pool_work_does_not() {
        let here = std::thread::current().id();
        let inline = FsWork::Inline {
            deadline: Instant::now() + Duration::from_secs(60),
        };
        let ran_on = |work: FsWork| async move {
            work.run("probe", || std::thread::current().id())
                .await
                .expect("ran")
        };
        assert_eq!(ran_on(inline).await, here);
        assert_ne!(ran_on(FsWork::Pool).await, here);
    }

    #[tokio::test]
    async fn no_inline_work_starts_past_the_deadline() {
        let over = FsWork::Inline {
            deadline: Instant::now(),
        };
        let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let outcome = over
            .run("probe", {
                let ran = ran.clone();
                move || ran.store(true, std::sync::atomic::Ordering::Relaxed)
            })
            .await;
        let error = outcome
            .expect_err("refused")
            .downcast()
            .expect_err("a trap");
        assert_eq!(
            error.downcast_ref::<wasmtime::Trap>(),
            Some(&wasmtime::Trap::Interrupt)
        );
        assert!(!ran.load(std::sync::atomic::Ordering::Relaxed));
    }
}
