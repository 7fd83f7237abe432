//! schedulelog: the durable storage engine of delayd.
//!
//! Messages are appended to a write-ahead log by one writer thread with group commit (one `fdatasync`
//! per group, acknowledged after it). A replayer copies each committed message into the schedule segment
//! of its delivery bucket (the first level of delayd's timing wheel), checkpointing its progress. Each
//! bucket also has a dispatch log of outcomes. Message ids locate their record without any global index.
//!
//! Layering, bottom up: [`frame`] (checksummed frames) → [`record`] (payloads) → `wal`, `segment`,
//! `dispatch`, `checkpoint`, `vote` (one file format each) → `commit` (the WAL's group commit),
//! [`Group`] (group commit for files written from many threads) and `replay` → [`ScheduleLog`].
//! Every byte layout is documented atop its module and in the crate's README.

#![deny(unsafe_code)]

mod bucket;
mod checkpoint;
mod clock;
mod commit;
mod dispatch;
mod entry;
mod error;
#[cfg(test)]
mod fault;
pub mod frame;
mod group;
mod header;
mod id;
mod inspect;
mod listing;
mod log;
mod proposals;
pub mod record;
mod replay;
mod schedules;
mod segment;
pub mod slow_disk;
mod sys;
mod view;
mod vote;
mod wal;

pub use bucket::{Bucket, SegmentMinutes};
pub use checkpoint::AppliedState;
pub use clock::{Clock, ManualClock, SystemClock};
pub use commit::{Ack, AckFuture, Appended, FsyncPolicy};
pub use entry::{
    app_payloads, Entry, EntryBuilder, EntryPayload, LogId, PlacedOutcome, MAX_APP_PAYLOAD_BYTES,
    MAX_ENTRY_BYTES,
};
pub use error::{AppendError, Error, Result};
pub use group::Group;
pub use header::{
    create_dir_durably, list_files, open_data_file, parse_offset_name, sync_dir, temp_path,
    write_atomically, OpenMode, TEMP_SUFFIX,
};
pub use id::{InvalidId, Location, MessageId};
pub use inspect::{inspect, write_end_of_frames};
pub use listing::{
    BucketCount, InvalidCursor, ListCursor, ListPage, ListQuery, Listed, StatusFilter,
};
pub use log::{
    Attempt, BucketSnapshot, LinkedSchedule, MessageState, MessageStatus, Options, ScheduleLog,
};
pub use proposals::{outcomes_bytes, FormedGroup, NextGroup, Proposals};
pub use record::{
    EncodedMessage, Message, MessageMeta, MessageRef, NewMessage, Outcome, OutcomeKind, ScheduleOp,
    TooLarge, FIRE_AT_HEADER, SCHEDULE_HEADER, SCHEDULE_SINK,
};
pub use replay::Replayed;
pub use schedules::{parse_fire_at, LastFiring, ScheduleState};
pub use segment::{IndexEntry, SegmentReader};
pub use sys::available_bytes;
pub use vote::{RaftState, Vote, VoteFile, VOTE_FILE_NAME};

#[cfg(test)]
mod tests;
