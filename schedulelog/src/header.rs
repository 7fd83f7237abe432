//! The 32-byte header at the start of every file the engine writes, and the small file-system helpers
//! every writer shares, in this crate and above it (durable directories, directory fsync, atomic
//! replace): one set, so that each gets the same temporary names, cleanup and slow-disk seam.
//!
//! ```text
//! offset  size  field
//! 0       8     magic            b"DLYDWAL\0", b"DLYDSEG\0", b"DLYDIDX\0", b"DLYDDSP\0" or b"DLYDMETA"
//! 8       2     version          u16 LE: FORMAT_VERSION; WAL files WAL_FORMAT_VERSION (2: the file may
//!                                be a reused one, holding an earlier use's frames past its own end),
//!                                or REPLICATED_WAL_VERSION (3: it holds Raft entries, entry.rs)
//! 10      2     segment_minutes  u16 LE (0 in WAL files)
//! 12      4     reserved         zero
//! 16      8     value            u64 LE: first seq (WAL), bucket start minute (segment, index, dispatch)
//! 24      4     reserved         zero
//! 28      4     crc              u32 LE, CRC-32C of bytes 0..28
//! ```

use crate::error::{Error, Result};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const HEADER_LEN: usize = 32;
pub const FORMAT_VERSION: u16 = 1;
/// WAL files are reused (wal.rs): version 1 promised zeros past the end of the log, which an older
/// delayd relies on to tell a torn tail from damage, so a reused file must not look like version 1 to it.
/// Version 1 WAL files are still read.
pub const WAL_FORMAT_VERSION: u16 = 2;
/// The WAL files of a replicated data dir hold Raft entries (entry.rs); a delayd that predates them
/// refuses the files by this version rather than take entry frames for damage.
pub const REPLICATED_WAL_VERSION: u16 = 3;

/// The version a file with this magic is written with (by a single node).
fn version_of(magic: [u8; 8]) -> u16 {
    match magic {
        WAL_MAGIC => WAL_FORMAT_VERSION,
        _ => FORMAT_VERSION,
    }
}

/// The newest version read of a file with this magic.
fn newest_version_of(magic: [u8; 8]) -> u16 {
    match magic {
        WAL_MAGIC => REPLICATED_WAL_VERSION,
        _ => FORMAT_VERSION,
    }
}

pub const WAL_MAGIC: [u8; 8] = *b"DLYDWAL\0";
pub const SEGMENT_MAGIC: [u8; 8] = *b"DLYDSEG\0";
pub const INDEX_MAGIC: [u8; 8] = *b"DLYDIDX\0";
pub const DISPATCH_MAGIC: [u8; 8] = *b"DLYDDSP\0";
pub const META_MAGIC: [u8; 8] = *b"DLYDMETA";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileHeader {
    pub magic: [u8; 8],
    pub segment_minutes: u16,
    pub value: u64,
}

impl FileHeader {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        self.encode_as(version_of(self.magic))
    }

    /// Encodes the header with a version other than the magic's usual one.
    pub(crate) fn encode_as(&self, version: u16) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..8].copy_from_slice(&self.magic);
        out[8..10].copy_from_slice(&version.to_le_bytes());
        out[10..12].copy_from_slice(&self.segment_minutes.to_le_bytes());
        out[16..24].copy_from_slice(&self.value.to_le_bytes());
        let crc = crc32c::crc32c(&out[..28]);
        out[28..32].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes and checks a header. `Err` carries the reason, for a corruption error or a torn-file check.
    pub fn decode(bytes: &[u8], magic: [u8; 8]) -> Result<FileHeader, &'static str> {
        FileHeader::decode_versioned(bytes, magic).map(|(header, _)| header)
    }

    /// [`FileHeader::decode`], with the file's format version.
    pub(crate) fn decode_versioned(
        bytes: &[u8],
        magic: [u8; 8],
    ) -> Result<(FileHeader, u16), &'static str> {
        let bytes = bytes
            .get(..HEADER_LEN)
            .ok_or("file shorter than its header")?;
        let crc = u32::from_le_bytes([bytes[28], bytes[29], bytes[30], bytes[31]]);
        if crc32c::crc32c(&bytes[..28]) != crc {
            return Err("file header checksum mismatch");
        }
        if bytes[0..8] != magic {
            return Err("wrong file magic");
        }
        let version = u16::from_le_bytes([bytes[8], bytes[9]]);
        if !(FORMAT_VERSION..=newest_version_of(magic)).contains(&version) {
            return Err("unsupported format version");
        }
        let mut value = [0u8; 8];
        value.copy_from_slice(&bytes[16..24]);
        let header = FileHeader {
            magic,
            segment_minutes: u16::from_le_bytes([bytes[10], bytes[11]]),
            value: u64::from_le_bytes(value),
        };
        Ok((header, version))
    }

    /// Decodes the header of the file at `path`, mapping a bad header to a corruption error.
    pub fn check(bytes: &[u8], magic: [u8; 8], path: &Path) -> Result<FileHeader> {
        FileHeader::decode(bytes, magic).map_err(|reason| Error::corrupt(path, 0, reason))
    }
}

/// Creates `dir` and any missing parents, each made durable by an fsync of the directory holding it.
pub fn create_dir_durably(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(parent) = parent {
        create_dir_durably(parent)?;
    }
    match fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(()),
        Err(e) => return Err(Error::io(dir)(e)),
    }
    sync_dir(parent.unwrap_or(Path::new(".")))
}

/// Makes the entries of `dir` (created, renamed or deleted files) durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    let dir_file = File::open(dir).map_err(Error::io(dir))?;
    crate::slow_disk::sync();
    dir_file.sync_all().map_err(Error::sync(dir))
}

/// How [`open_data_file`] opens a file for reading and writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// It must exist.
    Existing,
    /// Created if missing, kept as it is if not.
    Keep,
    /// Created if missing, emptied if not.
    Empty,
}

/// Opens the data file at `path` for reading and writing: every writer opens its files this way.
pub fn open_data_file(path: &Path, mode: OpenMode) -> std::io::Result<File> {
    fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(mode != OpenMode::Existing)
        .truncate(mode == OpenMode::Empty)
        .open(path)
}

/// The files in `dir` whose names `parse` accepts, each with what it made of its name, sorted by that.
/// Other files (a stranger's, a temporary one) are passed over.
pub fn list_files<T: Ord>(
    dir: &Path,
    parse: impl Fn(&str) -> Option<T>,
) -> Result<Vec<(T, PathBuf)>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).map_err(Error::io(dir))? {
        let path = entry.map_err(Error::io(dir))?.path();
        if let Some(parsed) = path.file_name().and_then(|n| n.to_str()).and_then(&parse) {
            files.push((parsed, path));
        }
    }
    files.sort();
    Ok(files)
}

/// The number a file named for an offset or a seq has as its name: 20 decimal digits.
pub fn parse_offset_name(name: &str) -> Option<u64> {
    name.len().eq(&20).then(|| name.parse().ok())?
}

/// Ends the name of the temporary file an atomic replace writes through. Appended to the name, not put
/// in the place of an extension: `a.b` and `a.c` written at once must not share `a.tmp`, nor may `a` write
/// through the file of something named `a.tmp`. `~` is in no name delayd gives a file (topics, groups,
/// sources), so a leftover is never taken for another file after a crash.
pub const TEMP_SUFFIX: &str = ".tmp~";

/// The temporary file [`write_atomically`] writes `path` through.
pub fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(TEMP_SUFFIX);
    PathBuf::from(name)
}

/// Replaces `path` with `bytes` atomically: write a temporary file, fsync it, rename it over `path`,
/// fsync the directory. A crash leaves either the old file or the new one, never a mix; a failure
/// leaves no temporary file behind.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_path(path);
    let written = File::create(&tmp)
        .and_then(|mut file| {
            file.write_all(bytes)?;
            Ok(file)
        })
        .map_err(Error::io(&tmp))
        .and_then(|file| {
            crate::slow_disk::sync();
            file.sync_all().map_err(Error::sync(&tmp))
        })
        .and_then(|()| fs::rename(&tmp, path).map_err(Error::io(path)));
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_reject_damage() {
        let header = FileHeader {
            magic: SEGMENT_MAGIC,
            segment_minutes: 60,
            value: 29_935_260,
        };
        let bytes = header.encode();
        assert_eq!(FileHeader::decode(&bytes, SEGMENT_MAGIC), Ok(header));
        assert_eq!(
            FileHeader::decode(&bytes, WAL_MAGIC),
            Err("wrong file magic")
        );
        for i in 0..HEADER_LEN {
            let mut bad = bytes;
            bad[i] ^= 0x40;
            assert!(FileHeader::decode(&bad, SEGMENT_MAGIC).is_err(), "byte {i}");
        }
        assert!(FileHeader::decode(&bytes[..31], SEGMENT_MAGIC).is_err());
    }

    #[test]
    fn wal_headers_are_version_2_or_3_and_version_1_is_still_read() {
        let header = FileHeader {
            magic: WAL_MAGIC,
            segment_minutes: 0,
            value: 7,
        };
        let with_version = |version: u16| {
            let mut bytes = header.encode();
            bytes[8..10].copy_from_slice(&version.to_le_bytes());
            let crc = crc32c::crc32c(&bytes[..28]);
            bytes[28..32].copy_from_slice(&crc.to_le_bytes());
            bytes
        };
        assert_eq!(header.encode()[8..10], WAL_FORMAT_VERSION.to_le_bytes());
        assert_eq!(FileHeader::decode(&with_version(1), WAL_MAGIC), Ok(header));
        assert_eq!(FileHeader::decode(&with_version(2), WAL_MAGIC), Ok(header));
        // A replicated data dir's files (Raft entries).
        assert_eq!(header.encode_as(3), with_version(3));
        assert_eq!(
            FileHeader::decode_versioned(&with_version(3), WAL_MAGIC),
            Ok((header, 3))
        );
        let unknown = Err("unsupported format version");
        assert_eq!(FileHeader::decode(&with_version(4), WAL_MAGIC), unknown);
        // Other files stay at version 1.
        let segment = FileHeader {
            magic: SEGMENT_MAGIC,
            ..header
        };
        let mut bytes = segment.encode();
        assert_eq!(bytes[8..10], 1u16.to_le_bytes());
        bytes[8..10].copy_from_slice(&2u16.to_le_bytes());
        let crc = crc32c::crc32c(&bytes[..28]);
        bytes[28..32].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(FileHeader::decode(&bytes, SEGMENT_MAGIC), unknown);
    }

    /// An atomic replace writes through `{name}.tmp~` (names differing after a dot do not share one)
    /// and leaves nothing behind when it fails.
    #[test]
    fn an_atomic_replace_replaces_and_a_failed_one_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.b");
        assert_eq!(temp_path(&path), dir.path().join("a.b.tmp~"));
        assert_ne!(temp_path(&path), temp_path(&dir.path().join("a.c")));
        write_atomically(&path, b"one").unwrap();
        write_atomically(&path, b"two").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        // A directory in the way: the rename fails.
        let blocked = dir.path().join("blocked");
        fs::create_dir(&blocked).unwrap();
        fs::write(blocked.join("inside"), b"").unwrap();
        assert!(matches!(
            write_atomically(&blocked, b"x"),
            Err(Error::Io { .. })
        ));
        assert!(!temp_path(&blocked).exists());
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }
}
