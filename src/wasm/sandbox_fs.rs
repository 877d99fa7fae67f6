//! The guest's `wasi:filesystem/types`: wasmtime-wasi's implementation behind a guard.
//!
//! Linked over wasmtime-wasi's own definition (see [`add_to_linker`]); every function delegates
//! to it except where the guard has something to say:
//!
//! ```text
//! symlink-at ───────────────────────────────▶ refused (not-permitted)
//! rename-at ─ parents opened beneath, real paths read
//!           ─ source a link, or source/destination a served path or above one? ─▶ refused
//!           ─ renamed on the checked parents; destination a link afterwards? removed, refused
//! link-at ─ source a link? ─▶ refused; destination a link afterwards? removed, refused
//! open-at / read-directory ─ descriptors held at the call's cap? ─▶ trap: fault `descriptors`
//! open-at ─ openat(O_NONBLOCK|O_NOFOLLOW beneath the directory), fstat
//!             ─ FIFO, socket, device ─────▶ closed, refused (never blocks a thread)
//!             ─ file or directory ────────▶ O_NONBLOCK cleared, counted while anything
//!                                            (the descriptor, a stream of it) holds it
//! read-directory ─▶ a streamed listing ([`super::dirstream`]), counted while it lives
//! set-size, sync, sync-data, unlink-file-at, open-at with truncate, the last close of a file
//!           ─▶ on the blocking pool even for a local grant (the kernel's work, not the guest's)
//! ```
//!
//! Why: the kubelet follows symlinks in a PV's path, and tenants' pods write into volume
//! directories that lie inside a guest's preopen. A guest must not be able to turn a path it
//! served into a link later, and a FIFO a pod planted must not hang a host thread in `open(2)`
//! (see `docs/threat-model.md`). Some calls cost the kernel time in proportion to what is on
//! disk, not to what the guest passes (freeing a fragmented file's blocks takes seconds): they
//! never run on the guest's thread, where the call's deadline could not end the wait.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};

use super::dirstream::{DirStream, SharedDirStream};
use super::rename::{RenameError, checked_rename};

use rustix::fs::{FileType, Mode, OFlags};
use wasmtime::component::{HasData, Linker, Resource};
use wasmtime_wasi::filesystem::{Descriptor, Dir, File, WasiFilesystemCtxView};
use wasmtime_wasi::p2::bindings::filesystem::types::{
    self, DescriptorFlags, DescriptorType, ErrorCode, HostDescriptor, HostDirectoryEntryStream,
    OpenFlags, PathFlags,
};
use wasmtime_wasi::p2::{DynInputStream, DynOutputStream};
use wasmtime_wasi::p2::{FsError, FsResult};
use wasmtime_wasi::{FsPerms, OpenMode};

use super::host::GuestState;

/// Something of the call's that keeps a host descriptor open: a file or directory `open-at`
/// created (its streams share it, so dropping the descriptor while a stream lives frees
/// nothing), or a directory listing (its own descriptor). Alive while the guest holds it.
#[derive(Debug)]
enum Held {
    /// The guard keeps a reference of its own, so that it, not the guest's drop, closes the
    /// file last: on the blocking pool ([`close_on_pool`]), since the last close of an unlinked
    /// file frees its blocks.
    File(Arc<std::fs::File>),
    Dir(Weak<std::fs::File>),
    Listing(Weak<Mutex<DirStream>>),
}

impl Held {
    fn alive(&self) -> bool {
        match self {
            Held::File(file) => Arc::strong_count(file) > 1,
            Held::Dir(dir) => dir.strong_count() > 0,
            Held::Listing(listing) => listing.strong_count() > 0,
        }
    }
}

/// Closes the files the guest no longer holds on the blocking pool (or here, outside a runtime).
fn close_on_pool(released: Vec<Held>) {
    if !released.iter().any(|held| matches!(held, Held::File(_))) {
        return;
    }
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn_blocking(move || drop(released))),
        Err(_) => drop(released),
    }
}

/// Runs `work` on the blocking pool, whatever the grant: for calls whose cost the kernel decides
/// rather than the guest, by what is on disk or by who holds the file's inode lock (truncating
/// or unlinking a fragmented file takes seconds; a pod's write stuck on a hung mount holds the
/// lock for as long as it likes). There, the call's deadline can end the wait.
async fn on_pool(
    what: &str,
    work: impl FnOnce() -> std::io::Result<()> + Send + 'static,
) -> FsResult<()> {
    blocking(false, what, work)
        .await?
        .map_err(|e| ErrorCode::from(e).into())
}

/// Runs `work` here when `inline` (a local grant's calls whose cost is what the guest passes),
/// else on the blocking pool, where the call's deadline can end the wait.
async fn blocking<R: Send + 'static>(
    inline: bool,
    what: &str,
    work: impl FnOnce() -> R + Send + 'static,
) -> FsResult<R> {
    if inline {
        return Ok(work());
    }
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| FsError::trap(wasmtime::Error::msg(format!("{what}: {e}"))))
}

/// Per-call state of the guard: the descriptors the guest holds and its cap on them.
#[derive(Debug)]
pub struct FsGuard {
    max_descriptors: usize,
    /// What the guest opened; dead entries are pruned when something new is admitted.
    held: Vec<Held>,
    /// Set when the guest tried to open more than `max_descriptors`.
    pub descriptors_hit: bool,
    /// Filesystem calls refused by the guard (links, special files), for the debug log.
    pub refused: u32,
    /// Filesystem calls run on the calling thread rather than the blocking pool.
    pub inline: bool,
}

impl FsGuard {
    /// A guard that lets one call hold at most `max_descriptors` open descriptors.
    pub fn new(max_descriptors: usize) -> FsGuard {
        FsGuard {
            max_descriptors,
            held: Vec::new(),
            descriptors_hit: false,
            refused: 0,
            inline: false,
        }
    }

    /// Host descriptors the guest's call holds right now: files and directories it opened
    /// (directly or through a stream), and listings (not counting its preopened directories).
    pub fn open_descriptors(&self) -> usize {
        self.held.iter().filter(|h| h.alive()).count()
    }

    /// Room for one more descriptor, or the trap that ends the call.
    fn admit(&mut self) -> Result<(), DescriptorCapHit> {
        close_on_pool(self.held.extract_if(.., |held| !held.alive()).collect());
        if self.held.len() >= self.max_descriptors {
            self.descriptors_hit = true;
            return Err(DescriptorCapHit(self.max_descriptors));
        }
        Ok(())
    }

    /// The cap on them.
    pub fn max_descriptors(&self) -> usize {
        self.max_descriptors
    }
}

impl Drop for FsGuard {
    fn drop(&mut self) {
        // The store's table went first (it is declared before the guard), so these are the
        // last references.
        close_on_pool(std::mem::take(&mut self.held));
    }
}

/// The trap raised when a call reaches its descriptor cap; [`super::runtime`] reports it as
/// the fault kind `descriptors`.
#[derive(Debug, thiserror::Error)]
#[error("the guest tried to hold more than {0} open descriptors in one call")]
pub struct DescriptorCapHit(pub usize);

/// wasmtime-wasi's filesystem view plus the guard.
pub struct SandboxFsView<'a> {
    inner: WasiFilesystemCtxView<'a>,
    guard: &'a mut FsGuard,
}

impl<'a> SandboxFsView<'a> {
    /// The view over one store's WASI filesystem state and its guard.
    pub fn new(inner: WasiFilesystemCtxView<'a>, guard: &'a mut FsGuard) -> Self {
        SandboxFsView { inner, guard }
    }

    /// The directory behind a descriptor and its permissions.
    fn dir_of(&self, fd: &Resource<Descriptor>) -> FsResult<(Arc<std::fs::File>, FsPerms)> {
        match self.inner.table.get(fd)? {
            Descriptor::Dir(dir) => Ok((Arc::clone(&dir.dir), dir.perms)),
            Descriptor::File(_) => Err(ErrorCode::NotDirectory.into()),
        }
    }

    /// The host file behind a descriptor, file or directory, and its permissions.
    fn handle_of(&self, fd: &Resource<Descriptor>) -> FsResult<(Arc<std::fs::File>, FsPerms)> {
        Ok(match self.inner.table.get(fd)? {
            Descriptor::Dir(dir) => (Arc::clone(&dir.dir), dir.perms),
            Descriptor::File(file) => (Arc::clone(&file.file), file.perms),
        })
    }

    /// The file behind a descriptor (wasmtime-wasi's `bad-descriptor` for a directory).
    fn file_of(&self, fd: &Resource<Descriptor>) -> FsResult<(Arc<std::fs::File>, FsPerms)> {
        match self.inner.table.get(fd)? {
            Descriptor::File(file) => Ok((Arc::clone(&file.file), file.perms)),
            Descriptor::Dir(_) => Err(ErrorCode::BadDescriptor.into()),
        }
    }

    fn refuse<T>(&mut self) -> FsResult<T> {
        self.guard.refused += 1;
        Err(ErrorCode::NotPermitted.into())
    }

    /// Whether `path` under the directory `fd` is itself a symlink (not following it).
    async fn is_symlink(&mut self, fd: &Resource<Descriptor>, path: &str) -> FsResult<bool> {
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
    async fn undo_if_symlink(&mut self, fd: &Resource<Descriptor>, path: &str) -> FsResult<()> {
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
fn borrow<T: 'static>(resource: &Resource<T>) -> Resource<T> {
    Resource::new_borrow(resource.rep())
}

/// [`HasData`] for the guarded filesystem.
pub struct SandboxFs;

impl HasData for SandboxFs {
    type Data<'a> = SandboxFsView<'a>;
}

/// Links `wasi:filesystem/types` through the guard, over the definition that
/// `wasmtime_wasi::p2::add_to_linker_async` put there (call that first).
pub fn add_to_linker(linker: &mut Linker<GuestState>) -> wasmtime::Result<()> {
    linker.allow_shadowing(true);
    let result = types::add_to_linker::<GuestState, SandboxFs>(linker, GuestState::sandbox_fs);
    linker.allow_shadowing(false);
    result
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

/// What [`open_beneath`] opened.
enum Opened {
    Dir(std::fs::File),
    File(std::fs::File),
}

/// Opens `path` beneath the directory `dir` without blocking: `O_NONBLOCK` so a FIFO cannot
/// hold the thread, then anything that is neither a regular file nor a directory is closed
/// and refused. Escapes (`..` above `dir`, absolute paths or links) fail as cap-std's do.
fn open_beneath(
    dir: &std::fs::File,
    path: &str,
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
        on_pool("sync-data", move || file.sync_data()).await
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
        on_pool("set-size", move || file.set_len(size)).await
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
        let stream = blocking(self.guard.inline, "read-directory", move || {
            DirStream::open(&dir)
        })
        .await??;
        let stream: SharedDirStream = Arc::new(Mutex::new(stream));
        self.guard.held.push(Held::Listing(Arc::downgrade(&stream)));
        let handle = self.inner.table.push(stream)?;
        // Under the handle type the bindings expect; only this module looks it up.
        Ok(Resource::new_own(handle.rep()))
    }

    async fn sync(&mut self, fd: Resource<Descriptor>) -> FsResult<()> {
        let (file, _) = self.handle_of(&fd)?;
        on_pool("sync", move || file.sync_all()).await
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
        let inline = self.guard.inline;
        // Truncating frees the file's blocks: the kernel's time, not the guest's.
        let opened = blocking(
            inline && !os.contains(OFlags::TRUNC),
            "open-at",
            move || open_beneath(&dir, &path, os, want_dir),
        )
        .await?;
        let descriptor = match opened {
            Ok(Opened::Dir(file)) => Descriptor::Dir(Dir::new(file, perms, mode, inline)),
            Ok(Opened::File(file)) => Descriptor::File(File::new(file, perms, mode, inline)),
            Err(ErrorCode::Access) => return self.refuse(),
            Err(code) => return Err(code.into()),
        };
        let held = match &descriptor {
            Descriptor::Dir(dir) => Held::Dir(Arc::downgrade(&dir.dir)),
            Descriptor::File(file) => Held::File(Arc::clone(&file.file)),
        };
        let handle = self.inner.table.push(descriptor)?;
        self.guard.held.push(held);
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
        HostDescriptor::remove_directory_at(&mut self.inner, fd, path).await
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
        let inline = self.guard.inline;
        // Local grants hold the index while renaming, so no volume is served in between; a
        // network grant's rename may block, so it checks and then renames.
        let outcome = blocking(inline, "rename-at", move || {
            checked_rename(&old_dir, &old_path, &new_dir, &new_path, inline)
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
        // wasmtime-wasi's own unlink (cap-primitives), on the pool.
        on_pool("unlink-file-at", move || {
            cap_primitives::fs::remove_file(&dir, std::path::Path::new(&path))
        })
        .await
    }

    fn read_via_stream(
        &mut self,
        fd: Resource<Descriptor>,
        offset: types::Filesize,
    ) -> FsResult<Resource<DynInputStream>> {
        HostDescriptor::read_via_stream(&mut self.inner, fd, offset)
    }

    fn write_via_stream(
        &mut self,
        fd: Resource<Descriptor>,
        offset: types::Filesize,
    ) -> FsResult<Resource<DynOutputStream>> {
        HostDescriptor::write_via_stream(&mut self.inner, fd, offset)
    }

    fn append_via_stream(
        &mut self,
        fd: Resource<Descriptor>,
    ) -> FsResult<Resource<DynOutputStream>> {
        HostDescriptor::append_via_stream(&mut self.inner, fd)
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
        let entry = blocking(self.guard.inline, "read-directory-entry", move || {
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
