//! The engine's only `unsafe`: thin wrappers over system calls std does not expose.

#![allow(unsafe_code)]

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Bytes this process can still write on the file system holding `path` (`statvfs`): `f_bavail *
/// f_frsize` for an ordinary user, `f_bfree * f_frsize` for root, who may also write into the blocks a
/// file system keeps for root (ext4: 5 % by default) and so meets `ENOSPC` only after them. What a
/// caller compares with a free-space reserve before taking more data.
pub fn available_bytes(path: &Path) -> io::Result<u64> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    let mut stats = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c_path` is a NUL-terminated string that outlives the call, and `stats` points to memory
    // large enough for a `statvfs`, which the call fills entirely when it returns 0 (and which is read
    // only then).
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), stats.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it initialised `stats`.
    let stats = unsafe { stats.assume_init() };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let blocks = if root { stats.f_bfree } else { stats.f_bavail };
    #[allow(clippy::unnecessary_cast)] // the field types differ between targets
    Ok((blocks as u64).saturating_mul(stats.f_frsize as u64))
}

/// The open-file limit (`RLIMIT_NOFILE`, soft): how many descriptors this process may have open.
pub(crate) fn open_file_limit() -> io::Result<u64> {
    let mut limit = std::mem::MaybeUninit::<libc::rlimit>::uninit();
    // SAFETY: `limit` points to memory large enough for an `rlimit`, which the call fills entirely when
    // it returns 0 (and which is read only then).
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, limit.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: getrlimit returned 0, so it initialised `limit`.
    #[allow(clippy::unnecessary_cast)] // the field type differs between targets
    Ok(unsafe { limit.assume_init() }.rlim_cur as u64)
}

/// Writes `slices`, one after the other, at `offset` of `file` (`pwritev`, as many at a time as the
/// system takes), so that many small buffers reach a file without being gathered into one first.
pub(crate) fn write_all_vectored_at(file: &File, slices: &[&[u8]], offset: u64) -> io::Result<()> {
    let mut slices: Vec<io::IoSlice<'_>> = slices
        .iter()
        .filter(|s| !s.is_empty())
        .map(|s| io::IoSlice::new(s))
        .collect();
    let mut slices = &mut slices[..];
    let mut offset = offset;
    while !slices.is_empty() {
        let count = slices.len().min(IOV_MAX);
        let Ok(at) = libc::off64_t::try_from(offset) else {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        };
        // SAFETY: `IoSlice` has the layout of `iovec` (std guarantees it on Unix), the first `count`
        // slices are valid for reads while borrowed here, and pwritev64 only reads them.
        let written = unsafe {
            libc::pwritev64(
                file.as_raw_fd(),
                slices.as_ptr().cast::<libc::iovec>(),
                count as libc::c_int,
                at,
            )
        };
        match written {
            -1 => {
                let error = io::Error::last_os_error();
                if error.kind() != io::ErrorKind::Interrupted {
                    return Err(error);
                }
            }
            0 => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            n => {
                let n = n as usize;
                offset += n as u64;
                io::IoSlice::advance_slices(&mut slices, n);
            }
        }
    }
    Ok(())
}

/// The most buffers one `pwritev` takes (Linux's `UIO_MAXIOV`).
const IOV_MAX: usize = 1024;

/// Starts writing back the dirty pages of `file` in `[offset, offset + len)` without waiting for them,
/// so that a later `fdatasync` finds little left to write.
pub(crate) fn start_writeback(file: &File, offset: u64, len: u64) -> io::Result<()> {
    let (Ok(offset), Ok(len)) = (
        libc::off64_t::try_from(offset),
        libc::off64_t::try_from(len),
    ) else {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    };
    // SAFETY: sync_file_range only reads its integer arguments; the descriptor is valid for as long as
    // `file` is borrowed, and a bad range or descriptor is reported through errno.
    let rc = unsafe {
        libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Allocates `len` bytes of disk for `file` from its start (`fallocate`, mode 0): the blocks are
/// reserved and read as zeros, without writing them. `Unsupported` where the file system cannot.
pub(crate) fn allocate(file: &File, len: u64) -> io::Result<()> {
    let Ok(len) = libc::off_t::try_from(len) else {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    };
    // SAFETY: fallocate only reads its integer arguments; the descriptor is valid for as long as `file`
    // is borrowed, and a bad length or descriptor is reported through errno.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) => Err(io::Error::new(io::ErrorKind::Unsupported, e)),
        _ => Err(e),
    }
}

/// Writes back every dirty page of the file system holding `file` and commits its journal (`syncfs`):
/// one flush of the device for all of them, where an `fdatasync` per file costs a journal commit and a
/// flush each. Reports a write-back error of any file on the file system since `file` was opened, and a
/// failed journal commit, where [`file_system_sync_is_reliable`] says so.
pub(crate) fn sync_file_system(file: &File) -> io::Result<()> {
    // SAFETY: syncfs only reads its descriptor argument, valid for as long as `file` is borrowed.
    let rc = unsafe { libc::syncfs(file.as_raw_fd()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether `syncfs` on the file system holding `file` can stand in for an `fdatasync` of each file:
/// Linux 5.17 or later (5.8 made it report write-back errors, 5.17 a failed journal commit; before,
/// it answered 0 regardless), on ext4, XFS or tmpfs. Not on an overlay (a container's root), whose
/// `syncfs` does not see the write-back errors of the file system beneath, nor on others not checked.
pub(crate) fn file_system_sync_is_reliable(file: &File) -> bool {
    const EXT4: i64 = 0xEF53;
    const XFS: i64 = 0x5846_5342;
    const TMPFS: i64 = 0x0102_1994;
    let Ok(release) = std::fs::read_to_string("/proc/sys/kernel/osrelease") else {
        return false;
    };
    let mut numbers = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().unwrap_or(0));
    let version = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
    let mut stats = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: `stats` points to memory large enough for a `statfs`, which the call fills entirely when
    // it returns 0 (and which is read only then); the descriptor is valid while `file` is borrowed.
    let rc = unsafe { libc::fstatfs(file.as_raw_fd(), stats.as_mut_ptr()) };
    if rc != 0 {
        return false;
    }
    // SAFETY: fstatfs returned 0, so it initialised `stats`.
    #[allow(clippy::unnecessary_cast)] // the field type differs between targets
    let kind = unsafe { stats.assume_init() }.f_type as i64;
    version >= (5, 17) && [EXT4, XFS, TMPFS].contains(&kind)
}

/// Tells the kernel that the cached pages of `file` in `[offset, offset + len)` will not be read soon, so
/// it can free them now (they must be clean, i.e. synced, to be dropped).
pub(crate) fn drop_cached_pages(file: &File, offset: u64, len: u64) -> io::Result<()> {
    let (Ok(offset), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    };
    // SAFETY: posix_fadvise only reads its integer arguments; the descriptor is valid for as long as
    // `file` is borrowed, and an invalid range is reported as an error, not undefined behaviour.
    let rc =
        unsafe { libc::posix_fadvise(file.as_raw_fd(), offset, len, libc::POSIX_FADV_DONTNEED) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn available_bytes_of_a_real_dir_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let free = available_bytes(dir.path()).unwrap();
        assert!(free > 0, "a temp dir with no space left: {free}");
        let missing = available_bytes(&dir.path().join("missing")).unwrap_err();
        assert_eq!(missing.kind(), io::ErrorKind::NotFound);
        let nul = available_bytes(Path::new("a\0b")).unwrap_err();
        assert_eq!(nul.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn vectored_writes_put_every_slice_in_order_past_the_system_limit_on_slices() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        // More slices than one pwritev takes, some empty, of every length from 0 to 6.
        let owned: Vec<Vec<u8>> = (0..3 * IOV_MAX + 7)
            .map(|i| vec![(i % 251) as u8; i % 7])
            .collect();
        let slices: Vec<&[u8]> = owned.iter().map(Vec::as_slice).collect();
        write_all_vectored_at(&file, &slices, 5).unwrap();
        let mut expected = vec![0u8; 5];
        expected.extend(owned.concat());
        assert_eq!(std::fs::read(&path).unwrap(), expected);
        write_all_vectored_at(&file, &[], 3).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), expected);
        let read_only = File::open(&path).unwrap();
        let error = write_all_vectored_at(&read_only, &[b"x"], 0).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EBADF));
    }

    #[test]
    fn the_open_file_limit_is_read() {
        // This very process has stdin, stdout and stderr open, so its limit is above 3.
        assert!(open_file_limit().unwrap() > 3);
    }
}
