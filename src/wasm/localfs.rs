//! Which guests may run their filesystem calls on the guest thread.
//!
//! A filesystem call on a network or user-space filesystem (NFS, SMB, FUSE, ...) can block its
//! thread for as long as the server is away; one on a local disk or in memory cannot (FIFOs,
//! sockets and devices are refused by [`super::sandbox_fs`] before they are opened). A guest whose
//! every granted directory, and every mount beneath one, is of a local type runs its filesystem
//! calls inline, which halves the cost of a call (docs/benchmarks.md); the others hop to the
//! blocking pool for each, so the call's deadline still fires while a thread waits on a dead
//! server.

use std::path::{Path, PathBuf};

/// Filesystem types whose calls finish without a remote party: block-device, memory and
/// overlay filesystems. Anything else (nfs, nfs4, cifs, smb3, fuse.*, ceph, 9p, ...) is treated
/// as able to hang.
const LOCAL_TYPES: &[&str] = &[
    "ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "tmpfs", "ramfs", "overlay", "vfat",
    "exfat", "ntfs", "ntfs3", "squashfs", "erofs", "iso9660",
];

/// One line of `/proc/self/mountinfo`: where it is mounted and the filesystem type.
pub(super) fn mount_of(line: &str) -> Option<(PathBuf, &str)> {
    let (before, after) = line.split_once(" - ")?;
    let point = before.split(' ').nth(4)?;
    let fstype = after.split(' ').next()?;
    Some((PathBuf::from(unescape(point)), fstype))
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo` (octal).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|d| {
            std::str::from_utf8(d)
                .ok()
                .and_then(|d| u8::from_str_radix(d, 8).ok())
        });
        match (bytes[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `dir` and everything mounted beneath it are local filesystems, per `mountinfo`.
pub fn is_local(mountinfo: &str, dir: &Path) -> bool {
    let mounts: Vec<(PathBuf, &str)> = mountinfo.lines().filter_map(mount_of).collect();
    // The mount holding `dir` is the last one listed whose point is a prefix (later mounts
    // stack over earlier ones on the same point).
    let holding = mounts
        .iter()
        .filter(|(point, _)| dir.starts_with(point))
        .max_by_key(|(point, _)| point.components().count());
    let Some((_, fstype)) = holding else {
        return false;
    };
    let local = |fstype: &str| LOCAL_TYPES.contains(&fstype);
    local(fstype)
        && mounts
            .iter()
            .filter(|(point, _)| point.starts_with(dir) && point != dir)
            .all(|(_, fstype)| local(fstype))
}

/// Whether every one of `dirs` is local (see [`is_local`]), read from this process' mount table.
/// Unknown (no mount table, a path that does not resolve) counts as not local.
pub fn all_local<'a>(dirs: impl IntoIterator<Item = &'a Path>) -> bool {
    let Ok(mountinfo) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    dirs.into_iter()
        .all(|dir| std::fs::canonicalize(dir).is_ok_and(|resolved| is_local(&mountinfo, &resolved)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
23 22 0:21 / /proc rw,nosuid shared:2 - proc proc rw
30 22 0:25 / /tmp rw shared:5 - tmpfs tmpfs rw
40 22 0:40 / /var/lib/nfs-volumes rw shared:9 - nfs4 server:/exports rw
41 22 8:1 /srv /var/lib/local\\040volumes rw shared:1 - ext4 /dev/sda1 rw
42 41 0:50 / /var/lib/local\\040volumes/remote rw shared:10 - fuse.sshfs host: rw
43 22 0:60 / /data rw shared:11 - xfs /dev/sdb rw
";

    #[test]
    fn local_only_when_the_dir_and_all_beneath_are_local() {
        let cases = [
            ("/data/volumes", true),
            ("/tmp/x", true),
            ("/var/lib/nfs-volumes", false),
            ("/var/lib/nfs-volumes/pvc-1", false),
            ("/var/lib", false),               // the NFS mount lies beneath
            ("/var/lib/local volumes", false), // a FUSE mount lies beneath
            ("/var/lib/local volumes/a", true),
            ("/proc", false),
            ("/etc", true), // on `/` (ext4), nothing mounted beneath
        ];
        for (dir, want) in cases {
            let got = is_local(MOUNTINFO, Path::new(dir));
            assert_eq!(got, want, "{dir}");
        }
    }

    #[test]
    fn the_last_mount_on_a_point_wins() {
        let stacked = "\
22 1 8:1 / / rw - ext4 /dev/sda1 rw
50 22 0:25 / /mnt rw - tmpfs tmpfs rw
51 50 0:40 / /mnt rw - nfs server:/x rw
";
        assert!(!is_local(stacked, Path::new("/mnt/a")));
    }

    #[test]
    fn unknown_mount_tables_are_not_local() {
        assert!(!is_local("", Path::new("/data")));
        assert!(!is_local("garbage without separator", Path::new("/data")));
    }

    #[test]
    fn escapes_are_decoded() {
        assert_eq!(unescape("/a\\040b\\134c"), "/a b\\c");
        assert_eq!(unescape("/plain\\"), "/plain\\");
    }

    #[test]
    fn this_processes_temporary_directory_is_judged() {
        // Whatever /tmp is here, the answer comes from the real mount table without panicking.
        let dir = tempfile::tempdir().expect("tempdir");
        let _ = all_local([dir.path()]);
        assert!(!all_local([Path::new("/does/not/exist")]));
    }
}
