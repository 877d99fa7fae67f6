//! `/proc/self/mountinfo`, read a line at a time: where each filesystem is mounted and its type
//! (the node-filesystem check, [`super::nodefs`], asks which mount holds a grant).

use std::path::PathBuf;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_gives_its_mount_point_and_type() {
        let line = "41 22 8:1 /srv /var/lib/local\\040volumes rw shared:1 - ext4 /dev/sda1 rw";
        assert_eq!(
            mount_of(line),
            Some((PathBuf::from("/var/lib/local volumes"), "ext4"))
        );
        assert_eq!(mount_of("garbage without separator"), None);
    }

    #[test]
    fn escapes_are_decoded() {
        assert_eq!(unescape("/a\\040b\\134c"), "/a b\\c");
        assert_eq!(unescape("/plain\\"), "/plain\\");
    }
}
