//! The engine's only `unsafe`: thin wrappers over system calls std does not expose.

#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

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
