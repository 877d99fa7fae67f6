//! The guest's `wasi:filesystem/types` and `preopens`: wasmtime-wasi's implementation behind a
//! guard.
//!
//! Linked over wasmtime-wasi's own definition (see [`add_to_linker`]); every function delegates
//! to it except where the guard has something to say (the primitives these overrides share,
//! the guarded view, opening beneath a directory and where the work runs, are in
//! [`super::fs_view`]):
//!
//! ```text
//! every call that touches the filesystem ─▶ on the call's own thread (its caller keeps the
//!                                          deadline), or the blocking pool off the executor
//! symlink-at ───────────────────────────────▶ refused (not-permitted)
//! rename-at ─ parents opened beneath, real paths read
//!           ─ source a link, or source/destination a served path or above one? ─▶ refused
//!           ─ renamed on the checked parents (the served index is not locked meanwhile: the
//!             move is announced to it instead, [`super::served`]); destination a link
//!             afterwards? removed, refused
//! link-at ─ source a link? ─▶ refused; destination a link afterwards? removed, refused
//! open-at, read-directory, get-directories, *-via-stream
//!           ─ handles at the call's cap ([`super::handles`])? ─▶ trap: fault `descriptors`
//! open-at ─ openat(O_NONBLOCK|O_NOFOLLOW beneath the directory), fstat
//!             ─ FIFO, socket, device ─────▶ closed, refused (never blocks a thread)
//!             ─ file or directory ────────▶ O_NONBLOCK cleared, counted while anything
//!                                            (the descriptor, a stream, an operation) holds it
//! read-directory ─▶ a streamed listing ([`super::dirstream`]), counted while it lives
//! ```
//!
//! Why: the kubelet follows symlinks in a PV's path, and tenants' pods write into volume
//! directories that lie inside a guest's preopen. A guest must not be able to turn a path it
//! served into a link later, and a FIFO a pod planted must not hang a host thread in `open(2)`
//! (see `docs/threat-model.md`). Any call that names a path or an inode can wait on a lock a
//! pod's process holds (a write stuck in the kernel holds its file's, a listing stuck on a
//! fault its directory's) for as long as that process likes, on any filesystem: such a wait
//! holds only the call's own thread, whose caller ends the call at its deadline
//! ([`super::call_clock`]), and the call is charged to the guest ([`super::handles`]) until the
//! kernel lets it go.

use std::sync::{Arc, Mutex};

use super::dirstream::{DirStream, SharedDirStream};
use super::fs_view::{Opened, SandboxFsView, borrow, open_beneath};
use super::handles::Held;
use super::rename::{RenameError, checked_rename};

use rustix::fs::OFlags;
use wasmtime::component::{HasData, Linker, Resource};
use wasmtime_wasi::OpenMode;
use wasmtime_wasi::filesystem::{Descriptor, Dir, File};
use wasmtime_wasi::p2::bindings::filesystem::preopens;
use wasmtime_wasi::p2::bindings::filesystem::types::{
    self, DescriptorFlags, DescriptorType, ErrorCode, HostDescriptor, HostDirectoryEntryStream,
    OpenFlags, PathFlags,
};
use wasmtime_wasi::p2::{DynInputStream, DynOutputStream};
use wasmtime_wasi::p2::{FsError, FsResult};

/// [`HasData`] for the guarded filesystem.
pub struct SandboxFs;

impl HasData for SandboxFs {
    type Data<'a> = SandboxFsView<'a>;
}

/// Links `wasi:filesystem/types` and `preopens` through the guard, over the definitions that
/// `wasmtime_wasi::p2::add_to_linker_async` put there (call that first); `view` is the store
/// state's guarded view (the per-call state knows this module, not the other way round).
pub fn add_to_linker<T: Send + 'static>(
    linker: &mut Linker<T>,
    view: fn(&mut T) -> SandboxFsView<'_>,
) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let result = types::add_to_linker::<T, SandboxFs>(linker, view)
        .and_then(|()| preopens::add_to_linker::<T, SandboxFs>(linker, view));
    linker.allow_shadowing(false);
    result
}

impl preopens::Host for SandboxFsView<'_> {
    /// Every call hands out new handles of the same directories: each counts, so asking again
    /// and again runs into the cap like opening does.
    fn get_directories(&mut self) -> wasmtime::Result<Vec<(Resource<Descriptor>, String)>> {
        self.guard.admit()?;
        let directories = preopens::Host::get_directories(&mut self.inner)?;
        for (handle, _) in &directories {
            if let Descriptor::Dir(dir) = self.inner.table.get(handle)? {
                self.guard.hold_preopen(&dir.dir);
            }
        }
        Ok(directories)
    }
}

impl types::Host for SandboxFsView<'_> {
    fn convert_error_code(&mut self, err: FsError) -> wasmtime::Result<ErrorCode> {
        types::Host::convert_error_code(&mut self.inner, err)
    }

    fn filesystem_error_code(
        &mut self,
        err: Resource<wasmtime::Error>,
    ) -> wasmtime::Result<Option<ErrorCode>> {
        types::Host::filesystem_error_code(&mut self.inner, err)
    }
}

impl HostDescriptor for SandboxFsView<'_> {
    async fn advise(
        &mut self,
        fd: Resource<Descriptor>,
        offset: types::Filesize,
        len: types::Filesize,
        advice: types::Advice,
    ) -> FsResult<()> {
        HostDescriptor::advise(&mut self.inner, fd, offset, len, advice).await
    }

    async fn sync_data(&mut self, fd: Resource<Descriptor>) -> FsResult<()> {
        let (file, _) = self.handle_of(&fd)?;
        self.guard
            .work
            .io("sync-data", move || file.sync_data())
            .await
    }

    async fn get_flags(&mut self, fd: Resource<Descriptor>) -> FsResult<DescriptorFlags> {
        HostDescriptor::get_flags(&mut self.inner, fd).await
    }

    async fn get_type(&mut self, fd: Resource<Descriptor>) -> FsResult<DescriptorType> {
        HostDescriptor::get_type(&mut self.inner, fd).await
    }

    async fn set_size(&mut self, fd: Resource<Descriptor>, size: types::Filesize) -> FsResult<()> {
        let (file, perms) = self.file_of(&fd)?;
        if perms.write_not_permitted() {
            return Err(ErrorCode::NotPermitted.into());
        }
        self.guard
            .work
            .io("set-size", move || file.set_len(size))
            .await
    }

    async fn set_times(
        &mut self,
        fd: Resource<Descriptor>,
        atim: types::NewTimestamp,
        mtim: types::NewTimestamp,
    ) -> FsResult<()> {
        HostDescriptor::set_times(&mut self.inner, fd, atim, mtim).await
    }

    async fn read(
        &mut self,
        fd: Resource<Descriptor>,
        len: types::Filesize,
        offset: types::Filesize,
    ) -> FsResult<(Vec<u8>, bool)> {
        HostDescriptor::read(&mut self.inner, fd, len, offset).await
    }

    async fn write(
        &mut self,
        fd: Resource<Descriptor>,
        buf: Vec<u8>,
        offset: types::Filesize,
    ) -> FsResult<types::Filesize> {
        HostDescriptor::write(&mut self.inner, fd, buf, offset).await
    }

    async fn read_directory(
        &mut self,
        fd: Resource<Descriptor>,
    ) -> FsResult<Resource<types::DirectoryEntryStream>> {
        let (dir, _) = self.dir_of(&fd)?;
        self.guard.admit().map_err(FsError::trap)?;
        let stream = self
            .guard
            .work
            .run("read-directory", move || DirStream::open(&dir))
            .await??;
        let stream: SharedDirStream = Arc::new(Mutex::new(stream));
        self.guard.hold(Held::Listing(Arc::downgrade(&stream)));
        let handle = self.inner.table.push(stream)?;
        // Under the handle type the bindings expect; only this module looks it up.
        Ok(Resource::new_own(handle.rep()))
    }

    async fn sync(&mut self, fd: Resource<Descriptor>) -> FsResult<()> {
        let (file, _) = self.handle_of(&fd)?;
        self.guard.work.io("sync", move || file.sync_all()).await
    }

    async fn create_directory_at(
        &mut self,
        fd: Resource<Descriptor>,
        path: String,
    ) -> FsResult<()> {
        HostDescriptor::create_directory_at(&mut self.inner, fd, path).await
    }

    async fn stat(&mut self, fd: Resource<Descriptor>) -> FsResult<types::DescriptorStat> {
        HostDescriptor::stat(&mut self.inner, fd).await
    }

    async fn stat_at(
        &mut self,
        fd: Resource<Descriptor>,
        path_flags: PathFlags,
        path: String,
    ) -> FsResult<types::DescriptorStat> {
        HostDescriptor::stat_at(&mut self.inner, fd, path_flags, path).await
    }

    async fn set_times_at(
        &mut self,
        fd: Resource<Descriptor>,
        path_flags: PathFlags,
        path: String,
        atim: types::NewTimestamp,
        mtim: types::NewTimestamp,
    ) -> FsResult<()> {
        HostDescriptor::set_times_at(&mut self.inner, fd, path_flags, path, atim, mtim).await
    }

    async fn link_at(
        &mut self,
        fd: Resource<Descriptor>,
        old_path_flags: PathFlags,
        old_path: String,
        new_descriptor: Resource<Descriptor>,
        new_path: String,
    ) -> FsResult<()> {
        if old_path_flags.contains(PathFlags::SYMLINK_FOLLOW)
            || self.is_symlink(&fd, &old_path).await?
        {
            return self.refuse();
        }
        HostDescriptor::link_at(
            &mut self.inner,
            fd,
            old_path_flags,
            old_path,
            borrow(&new_descriptor),
            new_path.clone(),
        )
        .await?;
        self.undo_if_symlink(&new_descriptor, &new_path).await
    }

    async fn open_at(
        &mut self,
        fd: Resource<Descriptor>,
        path_flags: PathFlags,
        path: String,
        oflags: OpenFlags,
        flags: DescriptorFlags,
    ) -> FsResult<Resource<Descriptor>> {
        self.guard.admit().map_err(FsError::trap)?;
        let (dir, perms) = self.dir_of(&fd)?;
        // The same flag rules as wasmtime-wasi's own open-at.
        if flags.intersects(
            DescriptorFlags::FILE_INTEGRITY_SYNC
                | DescriptorFlags::DATA_INTEGRITY_SYNC
                | DescriptorFlags::REQUESTED_WRITE_SYNC,
        ) {
            return Err(ErrorCode::Unsupported.into());
        }
        let want_dir = oflags.contains(OpenFlags::DIRECTORY);
        if want_dir
            && oflags.intersects(OpenFlags::CREATE | OpenFlags::EXCLUSIVE | OpenFlags::TRUNCATE)
        {
            return Err(ErrorCode::Invalid.into());
        }
        let mut os = OFlags::empty();
        let mut mode = OpenMode::empty();
        let create = oflags.contains(OpenFlags::CREATE);
        if create {
            os |= OFlags::CREATE;
            if oflags.contains(OpenFlags::EXCLUSIVE) {
                os |= OFlags::EXCL;
            }
            mode |= OpenMode::WRITE;
        }
        if oflags.contains(OpenFlags::TRUNCATE) {
            os |= OFlags::TRUNC;
            mode |= OpenMode::WRITE;
        }
        if flags.contains(DescriptorFlags::WRITE) {
            mode |= OpenMode::WRITE;
        }
        if flags.contains(DescriptorFlags::READ) || !flags.contains(DescriptorFlags::WRITE) {
            mode |= OpenMode::READ;
        }
        os |= match (
            mode.contains(OpenMode::READ),
            mode.contains(OpenMode::WRITE),
        ) {
            (true, true) => OFlags::RDWR,
            (false, true) => OFlags::WRONLY,
            _ => OFlags::RDONLY,
        };
        if want_dir {
            os |= OFlags::DIRECTORY;
        }
        if !path_flags.contains(PathFlags::SYMLINK_FOLLOW) {
            os |= OFlags::NOFOLLOW;
        }
        if perms.write_not_permitted() && mode.contains(OpenMode::WRITE) {
            return Err(ErrorCode::NotPermitted.into());
        }
        let path = super::rawname::host_path(&path)?;
        let opened = self
            .guard
            .work
            .run("open-at", move || open_beneath(&dir, &path, os, want_dir))
            .await?;
        // wasmtime-wasi runs what it does with them where the guard's own calls run.
        let descriptor = match opened {
            Ok(Opened::Dir(file)) => {
                Descriptor::Dir(Dir::new(file, perms, mode, self.guard.work.inline()))
            }
            Ok(Opened::File(file)) => {
                Descriptor::File(File::new(file, perms, mode, self.guard.work.inline()))
            }
            Err(ErrorCode::Access) => return self.refuse(),
            Err(code) => return Err(code.into()),
        };
        let held = match &descriptor {
            Descriptor::Dir(dir) => Held::Dir(Arc::downgrade(&dir.dir)),
            Descriptor::File(file) => Held::File(Arc::clone(&file.file)),
        };
        let handle = self.inner.table.push(descriptor)?;
        self.guard.hold(held);
        Ok(handle)
    }

    fn drop(&mut self, fd: Resource<Descriptor>) -> wasmtime::Result<()> {
        HostDescriptor::drop(&mut self.inner, fd)
    }

    async fn readlink_at(&mut self, fd: Resource<Descriptor>, path: String) -> FsResult<String> {
        HostDescriptor::readlink_at(&mut self.inner, fd, path).await
    }

    async fn remove_directory_at(
        &mut self,
        fd: Resource<Descriptor>,
        path: String,
    ) -> FsResult<()> {
        let (dir, perms) = self.dir_of(&fd)?;
        if perms.write_not_permitted() {
            return Err(ErrorCode::NotPermitted.into());
        }
        let path = super::rawname::host_path(&path)?;
        // wasmtime-wasi's own removal (cap-primitives), on the pool, with the name mapped.
        self.guard
            .work
            .io("remove-directory-at", move || {
                cap_primitives::fs::remove_dir(&dir, &path)
            })
            .await
    }

    async fn rename_at(
        &mut self,
        fd: Resource<Descriptor>,
        old_path: String,
        new_fd: Resource<Descriptor>,
        new_path: String,
    ) -> FsResult<()> {
        let (old_dir, old_perms) = self.dir_of(&fd)?;
        let (new_dir, new_perms) = self.dir_of(&new_fd)?;
        // The same permission rules as wasmtime-wasi's own rename-at.
        if old_perms.write_not_permitted()
            || new_perms.write_not_permitted()
            || old_perms != new_perms
        {
            return Err(ErrorCode::NotPermitted.into());
        }
        let old_path = super::rawname::host_path(&old_path)?;
        let new_path = super::rawname::host_path(&new_path)?;
        let outcome = self
            .guard
            .work
            .run("rename-at", move || {
                checked_rename(&old_dir, &old_path, &new_dir, &new_path)
            })
            .await?;
        match outcome {
            Ok(()) => Ok(()),
            Err(RenameError::Code(code)) => Err(code.into()),
            Err(RenameError::Refused(why)) => {
                tracing::debug!(why, "rename-at refused");
                self.refuse()
            }
        }
    }

    async fn symlink_at(
        &mut self,
        _fd: Resource<Descriptor>,
        _src_path: String,
        _dest_path: String,
    ) -> FsResult<()> {
        // The kubelet follows links in a PV's path: a guest may never create one.
        self.refuse()
    }

    async fn unlink_file_at(&mut self, fd: Resource<Descriptor>, path: String) -> FsResult<()> {
        let (dir, perms) = self.dir_of(&fd)?;
        if perms.write_not_permitted() {
            return Err(ErrorCode::NotPermitted.into());
        }
        let path = super::rawname::host_path(&path)?;
        // wasmtime-wasi's own unlink (cap-primitives), on the pool, with the name mapped.
        self.guard
            .work
            .io("unlink-file-at", move || {
                cap_primitives::fs::remove_file(&dir, &path)
            })
            .await
    }

    fn read_via_stream(
        &mut self,
        fd: Resource<Descriptor>,
        offset: types::Filesize,
    ) -> FsResult<Resource<DynInputStream>> {
        self.admit_stream()?;
        let stream = HostDescriptor::read_via_stream(&mut self.inner, fd, offset)?;
        self.guard.stream_made(stream.rep());
        Ok(stream)
    }

    fn write_via_stream(
        &mut self,
        fd: Resource<Descriptor>,
        offset: types::Filesize,
    ) -> FsResult<Resource<DynOutputStream>> {
        self.admit_stream()?;
        let stream = HostDescriptor::write_via_stream(&mut self.inner, fd, offset)?;
        self.guard.stream_made(stream.rep());
        Ok(stream)
    }

    fn append_via_stream(
        &mut self,
        fd: Resource<Descriptor>,
    ) -> FsResult<Resource<DynOutputStream>> {
        self.admit_stream()?;
        let stream = HostDescriptor::append_via_stream(&mut self.inner, fd)?;
        self.guard.stream_made(stream.rep());
        Ok(stream)
    }

    async fn is_same_object(
        &mut self,
        a: Resource<Descriptor>,
        b: Resource<Descriptor>,
    ) -> wasmtime::Result<bool> {
        HostDescriptor::is_same_object(&mut self.inner, a, b).await
    }

    async fn metadata_hash(
        &mut self,
        fd: Resource<Descriptor>,
    ) -> FsResult<types::MetadataHashValue> {
        HostDescriptor::metadata_hash(&mut self.inner, fd).await
    }

    async fn metadata_hash_at(
        &mut self,
        fd: Resource<Descriptor>,
        path_flags: PathFlags,
        path: String,
    ) -> FsResult<types::MetadataHashValue> {
        HostDescriptor::metadata_hash_at(&mut self.inner, fd, path_flags, path).await
    }
}

impl HostDirectoryEntryStream for SandboxFsView<'_> {
    async fn read_directory_entry(
        &mut self,
        stream: Resource<types::DirectoryEntryStream>,
    ) -> FsResult<Option<types::DirectoryEntry>> {
        let listing: Resource<SharedDirStream> = Resource::new_borrow(stream.rep());
        let listing = Arc::clone(self.inner.table.get(&listing)?);
        let entry = self
            .guard
            .work
            .run("read-directory-entry", move || {
                listing
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .next_entry()
            })
            .await?;
        Ok(entry?)
    }

    fn drop(&mut self, stream: Resource<types::DirectoryEntryStream>) -> wasmtime::Result<()> {
        let listing: Resource<SharedDirStream> = Resource::new_own(stream.rep());
        self.inner.table.delete(listing)?;
        Ok(())
    }
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (at start, before any guest runs), so the
/// per-call descriptor caps, not the process' limit, are what guests meet. Returns the soft
/// limit before and after.
pub fn raise_nofile_limit() -> std::io::Result<(Option<u64>, Option<u64>)> {
    use rustix::process::{Resource as Limit, getrlimit, setrlimit};
    let before = getrlimit(Limit::Nofile);
    let mut raised = before;
    raised.current = match before.maximum {
        Some(hard) => Some(hard),
        // Unlimited hard limit: the kernel still caps at fs.nr_open (1 Mi by default).
        None => Some(1 << 20),
    };
    if raised.current == before.current {
        return Ok((before.current, before.current));
    }
    setrlimit(Limit::Nofile, raised)?;
    Ok((before.current, raised.current))
}
