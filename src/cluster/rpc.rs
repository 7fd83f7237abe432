//! The binary codec of Raft's RPCs on the peer link (peer.rs): a request's kind is the link's kind
//! byte ([`VOTE`], [`APPEND`], and a snapshot's three: [`SNAPSHOT_OFFER`], [`SNAPSHOT_CHUNK`],
//! [`SNAPSHOT_INSTALL`]), its body and its answer's are encoded here.
//! Little endian; every message opens with the codec's version and says what it is.
//!
//! ```text
//! message          version u8 (1), message u8 (the request's kind; its answer's has 0x80 set), body
//! log_id           term u64, node_id u64, index u64                                      24 bytes
//! opt<log_id>      0 u8 | 1 u8, log_id
//! vote             term u64, node_id u64, committed u8 (0 or 1)                          17 bytes
//!
//! VOTE 1           request  vote, last_log_id opt<log_id>
//!                  answer   vote, granted u8 (0 or 1), last_log_id opt<log_id>
//! APPEND 2         request  vote, prev_log_id opt<log_id>, leader_commit opt<log_id>,
//!                           count u32, count × entry
//!                  entry    log_id, payload u8, then by payload:
//!                             0 blank       nothing
//!                             1 normal      len u32, the proposal's frames (len bytes, as they are)
//!                             2 membership  len u32, the membership as JSON (len bytes; rare)
//!                  answer   outcome u8, then by outcome:
//!                             0 success         nothing
//!                             1 partial success matching opt<log_id>
//!                             2 conflict        nothing
//!                             3 higher vote     vote
//! str              len u16, UTF-8 bytes
//! SNAPSHOT_OFFER 3 request  vote, meta (len u32, openraft's SnapshotMeta as JSON), count u32,
//!                           count × (path str, len u64): the snapshot's files (snapshot.rs)
//!                  answer   count u32, count × have u64: the bytes of each file the member holds
//! SNAPSHOT_CHUNK 4 request  vote, snapshot id str, file u32 (its place in the offer), offset u64,
//!                           crc u32 (CRC-32C of the bytes), len u32, the bytes
//!                  answer   have u64: the file's bytes the member holds now (offset + len once
//!                           taken; where it was when refused: the sender sends from there)
//! SNAPSHOT_INSTALL 5 request vote, snapshot id str
//!                  answer   vote (openraft's SnapshotResponse)
//!
//! error answer     the link's error status; its text is the member's `RaftError<u64>` as JSON
//!                  ([`raft_error_text`]). Any other text is a request the member could not take
//!                  (undecodable, of an unknown kind, from a member that is not the vote's) or the
//!                  link's own (a handler over its deadline).
//! ```
//!
//! Invariants:
//! - Decoding never panics, whatever the bytes, and allocates in proportion to their number, whatever
//!   a length or count claims: every read is checked against what remains, and a count of entries
//!   against the least room they take ([`MIN_ENTRY_LEN`] each) before anything is allocated for them.
//!   A flag is 0 or 1 and a tag one of its values, exactly; bytes after a message's end are an error.
//!   An error names the message, what was wrong and its byte offset.
//! - A decoded membership has at least one config and a node for each of its voters, as openraft's
//!   `Membership::new` makes them; openraft looks its voters' nodes up and expects to find them.
//! - A proposal's frames are copied once on each side: into the encoded request, and out of it into
//!   the decoded entry. Their meaning is not the codec's business.
//! - The version changes with any change to this layout: a member that meets another version answers
//!   an error (the caller sees a network error and retries) rather than guess.

use super::{Member, Proposal, TypeConfig};
use openraft::error::RaftError;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::{Entry, EntryPayload, LeaderId, LogId, Membership, SnapshotMeta, Vote};

/// The codec's version, the first byte of every message.
pub const VERSION: u8 = 1;

/// A vote request's kind on the peer link.
pub const VOTE: u8 = 1;
/// An append-entries request's kind on the peer link.
pub const APPEND: u8 = 2;
/// A snapshot offered: which files, and how much of each the member has already (snapshot.rs).
pub const SNAPSHOT_OFFER: u8 = 3;
/// Bytes of a snapshot's file.
pub const SNAPSHOT_CHUNK: u8 = 4;
/// A snapshot sent whole: install it.
pub const SNAPSHOT_INSTALL: u8 = 5;

/// Set in the message byte of an answer.
const ANSWER: u8 = 0x80;
const HEADER_LEN: usize = 2;
const LOG_ID_LEN: usize = 8 + 8 + 8;
const OPT_LOG_ID_LEN: usize = 1 + LOG_ID_LEN;
const VOTE_LEN: usize = 8 + 8 + 1;
/// The least room an entry takes: a blank one, its log id and payload tag.
pub const MIN_ENTRY_LEN: usize = LOG_ID_LEN + 1;

const PAYLOAD_BLANK: u8 = 0;
const PAYLOAD_NORMAL: u8 = 1;
const PAYLOAD_MEMBERSHIP: u8 = 2;

const OUTCOME_SUCCESS: u8 = 0;
const OUTCOME_PARTIAL_SUCCESS: u8 = 1;
const OUTCOME_CONFLICT: u8 = 2;
const OUTCOME_HIGHER_VOTE: u8 = 3;

/// A message of the codec: a request or its answer.
pub trait Wire: Sized {
    /// Its message byte: the request's kind, with 0x80 set for its answer.
    const MESSAGE: u8;
    /// What it is called in errors.
    const NAME: &'static str;

    /// The message, header first.
    fn encode(&self) -> Result<Vec<u8>, EncodeError>;

    /// The message in `bytes`, which must hold exactly one.
    fn decode(bytes: &[u8]) -> Result<Self, DecodeError>;
}

/// Why a message could not be encoded: never for votes, and for entries only past the format's
/// 4 GiB lengths (far past what the peer link carries) or for a membership serde refuses.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    #[error("{what} of {len} is over the codec's limit of {max}", max = u32::MAX)]
    TooLarge { what: &'static str, len: usize },
    #[error("a membership entry does not serialize: {0}")]
    Membership(#[source] serde_json::Error),
    #[error("a snapshot's meta does not serialize: {0}")]
    Meta(#[source] serde_json::Error),
}

/// Why bytes are not the message they were taken for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message} at byte {offset}: {problem}")]
pub struct DecodeError {
    /// The message being decoded ([`Wire::NAME`]).
    pub message: &'static str,
    /// Where what was wrong begins.
    pub offset: usize,
    pub problem: Problem,
}

/// What was wrong with a message's bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    #[error("{what} needs {needed} bytes, {remaining} remain")]
    Truncated {
        what: &'static str,
        needed: usize,
        remaining: usize,
    },
    #[error("codec version {found}, this member speaks {VERSION}")]
    Version { found: u8 },
    #[error("message {found:#04x}, not {expected:#04x}")]
    Message { found: u8, expected: u8 },
    #[error("{what} {found} is none of {valid}")]
    Invalid {
        what: &'static str,
        found: u8,
        valid: &'static str,
    },
    #[error("{count} entries cannot fit in the {remaining} bytes that remain")]
    TooManyEntries { count: u32, remaining: usize },
    #[error("not a membership: {why}")]
    Membership { why: String },
    #[error("not a snapshot's meta: {why}")]
    Meta { why: String },
    #[error("{what} is not UTF-8")]
    NotUtf8 { what: &'static str },
    #[error("{len} bytes after its end")]
    Trailing { len: usize },
}

/// The error text of a member's answer to a request it took: its `RaftError` as JSON, which
/// [`raft_error_from_text`] reads back. (Serializing it cannot fail in practice; if it did, the
/// caller would get its display text, which it takes for a network error.)
pub fn raft_error_text(error: &RaftError<u64>) -> String {
    serde_json::to_string(error).unwrap_or_else(|_| error.to_string())
}

/// The member's `RaftError` in an error answer's text, or `None` for any other text.
pub fn raft_error_from_text(text: &str) -> Option<RaftError<u64>> {
    serde_json::from_str(text).ok()
}

impl Wire for VoteRequest<u64> {
    const MESSAGE: u8 = VOTE;
    const NAME: &'static str = "a vote request";

    fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = header::<Self>(VOTE_LEN + opt_log_id_len(&self.last_log_id));
        put_vote(&mut out, &self.vote);
        put_opt_log_id(&mut out, self.last_log_id.as_ref());
        Ok(out)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        Reader::message::<Self, _>(bytes, |r| {
            Ok(VoteRequest {
                vote: r.vote("vote")?,
                last_log_id: r.opt_log_id("last_log_id")?,
            })
        })
    }
}

impl Wire for VoteResponse<u64> {
    const MESSAGE: u8 = VOTE | ANSWER;
    const NAME: &'static str = "a vote answer";

    fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = header::<Self>(VOTE_LEN + 1 + opt_log_id_len(&self.last_log_id));
        put_vote(&mut out, &self.vote);
        out.push(u8::from(self.vote_granted));
        put_opt_log_id(&mut out, self.last_log_id.as_ref());
        Ok(out)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        Reader::message::<Self, _>(bytes, |r| {
            Ok(VoteResponse {
                vote: r.vote("vote")?,
                vote_granted: r.flag("granted")?,
                last_log_id: r.opt_log_id("last_log_id")?,
            })
        })
    }
}

impl Wire for AppendEntriesRequest<TypeConfig> {
    const MESSAGE: u8 = APPEND;
    const NAME: &'static str = "an append-entries request";

    fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        // Memberships are serialized first (one for each entry that is one), so that the buffer is
        // sized once, frames included.
        let memberships = self
            .entries
            .iter()
            .map(|entry| match &entry.payload {
                EntryPayload::Membership(membership) => serde_json::to_vec(membership).map(Some),
                EntryPayload::Blank | EntryPayload::Normal(_) => Ok(None),
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(EncodeError::Membership)?;
        let entries_len: usize = self
            .entries
            .iter()
            .zip(&memberships)
            .map(|(entry, membership)| match (&entry.payload, membership) {
                (EntryPayload::Normal(proposal), _) => MIN_ENTRY_LEN + 4 + proposal.frames.len(),
                (_, Some(json)) => MIN_ENTRY_LEN + 4 + json.len(),
                (_, None) => MIN_ENTRY_LEN,
            })
            .sum();
        let options_len = opt_log_id_len(&self.prev_log_id) + opt_log_id_len(&self.leader_commit);
        let mut out = header::<Self>(VOTE_LEN + options_len + 4 + entries_len);
        put_vote(&mut out, &self.vote);
        put_opt_log_id(&mut out, self.prev_log_id.as_ref());
        put_opt_log_id(&mut out, self.leader_commit.as_ref());
        put_len(&mut out, "a batch of entries", self.entries.len())?;
        for (entry, membership) in self.entries.iter().zip(&memberships) {
            put_log_id(&mut out, &entry.log_id);
            match (&entry.payload, membership) {
                (EntryPayload::Normal(proposal), _) => {
                    out.push(PAYLOAD_NORMAL);
                    put_len(&mut out, "a proposal's frames", proposal.frames.len())?;
                    out.extend_from_slice(&proposal.frames);
                }
                (_, Some(json)) => {
                    out.push(PAYLOAD_MEMBERSHIP);
                    put_len(&mut out, "a membership", json.len())?;
                    out.extend_from_slice(json);
                }
                (_, None) => out.push(PAYLOAD_BLANK),
            }
        }
        Ok(out)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        Reader::message::<Self, _>(bytes, |r| {
            let vote = r.vote("vote")?;
            let prev_log_id = r.opt_log_id("prev_log_id")?;
            let leader_commit = r.opt_log_id("leader_commit")?;
            let count_at = r.at;
            let count = r.u32("the count of entries")?;
            let remaining = r.remaining();
            if (count as usize) > remaining / MIN_ENTRY_LEN {
                return Err(r.error(count_at, Problem::TooManyEntries { count, remaining }));
            }
            let mut entries = Vec::with_capacity(count as usize);
            for _ in 0..count {
                entries.push(r.entry()?);
            }
            Ok(AppendEntriesRequest {
                vote,
                prev_log_id,
                leader_commit,
                entries,
            })
        })
    }
}

impl Wire for AppendEntriesResponse<u64> {
    const MESSAGE: u8 = APPEND | ANSWER;
    const NAME: &'static str = "an append-entries answer";

    fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = header::<Self>(1 + OPT_LOG_ID_LEN.max(VOTE_LEN));
        match self {
            AppendEntriesResponse::Success => out.push(OUTCOME_SUCCESS),
            AppendEntriesResponse::PartialSuccess(matching) => {
                out.push(OUTCOME_PARTIAL_SUCCESS);
                put_opt_log_id(&mut out, matching.as_ref());
            }
            AppendEntriesResponse::Conflict => out.push(OUTCOME_CONFLICT),
            AppendEntriesResponse::HigherVote(vote) => {
                out.push(OUTCOME_HIGHER_VOTE);
                put_vote(&mut out, vote);
            }
        }
        Ok(out)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        Reader::message::<Self, _>(bytes, |r| {
            let at = r.at;
            match r.u8("the outcome")? {
                OUTCOME_SUCCESS => Ok(AppendEntriesResponse::Success),
                OUTCOME_PARTIAL_SUCCESS => Ok(AppendEntriesResponse::PartialSuccess(
                    r.opt_log_id("matching")?,
                )),
                OUTCOME_CONFLICT => Ok(AppendEntriesResponse::Conflict),
                OUTCOME_HIGHER_VOTE => Ok(AppendEntriesResponse::HigherVote(r.vote("vote")?)),
                found => Err(r.error(
                    at,
                    Problem::Invalid {
                        what: "the outcome",
                        found,
                        valid: "0 (success), 1 (partial), 2 (conflict), 3 (higher vote)",
                    },
                )),
            }
        })
    }
}

/// A snapshot offered to a member ([`SNAPSHOT_OFFER`]): its meta and its files, by path and length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotOffer {
    pub vote: Vote<u64>,
    pub meta: SnapshotMeta<u64, Member>,
    pub files: Vec<(String, u64)>,
}

/// A member's answer to an offer: how many bytes of each offered file it holds already.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotHave {
    pub have: Vec<u64>,
}

/// Bytes of one of a snapshot's files ([`SNAPSHOT_CHUNK`]), at `offset`, with their CRC-32C.
#[derive(Clone, PartialEq, Eq)]
pub struct SnapshotChunk {
    pub vote: Vote<u64>,
    pub snapshot_id: String,
    pub file: u32,
    pub offset: u64,
    pub crc: u32,
    pub bytes: Vec<u8>,
}

impl std::fmt::Debug for SnapshotChunk {
    /// The length only: a chunk is a megabyte.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotChunk")
            .field("snapshot_id", &self.snapshot_id)
            .field("file", &self.file)
            .field("offset", &self.offset)
            .field("len", &self.bytes.len())
            .finish_non_exhaustive()
    }
}

/// A member's answer to a chunk: the file's bytes it holds now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkTaken {
    pub have: u64,
}

/// A snapshot whose files were all sent: install it ([`SNAPSHOT_INSTALL`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInstall {
    pub vote: Vote<u64>,
    pub snapshot_id: String,
}

/// The least room a file of an offer takes: an empty path's length and the file's length.
const MIN_OFFERED_FILE_LEN: usize = 2 + 8;

impl Wire for SnapshotOffer {
    const MESSAGE: u8 = SNAPSHOT_OFFER;
    const NAME: &'static str = "a snapshot offer";

    fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let meta = serde_json::to_vec(&self.meta).map_err(EncodeError::Meta)?;
        let files_len: usize = self.files.iter().map(|(p, _)| 2 + p.len() + 8).sum();
        let mut out = header::<Self>(VOTE_LEN + 4 + meta.len() + 4 + files_len);
        put_vote(&mut out, &self.vote);
        put_len(&mut out, "a snapshot's meta", meta.len())?;
        out.extend_from_slice(&meta);
        put_len(&mut out, "a snapshot's files", self.files.len())?;
        for (path, len) in &self.files {
            put_str(&mut out, path)?;
            out.extend_from_slice(&len.to_le_bytes());
        }
        Ok(out)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        Reader::message::<Self, _>(bytes, |r| {
            let vote = r.vote("vote")?;
            let len = r.u32("the meta's length")? as usize;
            let meta_at = r.at;
            let json = r.take(len, "the meta")?;
            let meta: SnapshotMeta<u64, Member> = serde_json::from_slice(json)
                .map_err(|e| r.error(meta_at, Problem::Meta { why: e.to_string() }))?;
            let stored = meta.last_membership.membership();
            if meta.last_membership.log_id().is_some() {
                let json = serde_json::to_vec(stored)
                    .map_err(|e| r.error(meta_at, Problem::Membership { why: e.to_string() }))?;
                membership(&json).map_err(|why| r.error(meta_at, Problem::Membership { why }))?;
            }
            let count_at = r.at;
            let count = r.u32("the count of files")?;
            let remaining = r.remaining();
            if (count as usize) > remaining / MIN_OFFERED_FILE_LEN {
                return Err(r.error(count_at, Problem::TooManyEntries { count, remaining }));
            }
            let mut files = Vec::with_capacity(count as usize);
            for _ in 0..count {
                let path = r.str("a file's path")?;
                files.push((path, r.u64("a file's length")?));
            }
            Ok(SnapshotOffer { vote, meta, files })
        })
    }
}

impl Wire for SnapshotHave {
    const MESSAGE: u8 = SNAPSHOT_OFFER | ANSWER;
    const NAME: &'static str = "a snapshot offer's answer";

    fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = header::<Self>(4 + 8 * self.have.len());
        put_len(&mut out, "a snapshot's files", self.have.len())?;
        for have in &self.have {
            out.extend_from_slice(&have.to_le_bytes());
        }
        Ok(out)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        Reader::message::<Self, _>(bytes, |r| {
            let count_at = r.at;
            let count = r.u32("the count of files")?;
            let remaining = r.remaining();
            if (count as usize) > remaining / 8 {
                return Err(r.error(count_at, Problem::TooManyEntries { count, remaining }));
            }
            let have = (0..count)
                .map(|_| r.u64("a file's bytes held"))
                .collect::<Result<_, _>>()?;
            Ok(SnapshotHave { have })
        })
    }
}

impl Wire for SnapshotChunk {
    const MESSAGE: u8 = SNAPSHOT_CHUNK;
    const NAME: &'static str = "a snapshot chunk";

    fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let body = VOTE_LEN + 2 + self.snapshot_id.len() + 4 + 8 + 4 + 4 + self.bytes.len();
        let mut out = header::<Self>(body);
        put_vote(&mut out, &self.vote);
        put_str(&mut out, &self.snapshot_id)?;
        out.extend_from_slice(&self.file.to_le_bytes());
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.crc.to_le_bytes());
        put_len(&mut out, "a snapshot chunk", self.bytes.len())?;
        out.extend_from_slice(&self.bytes);
        Ok(out)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        Reader::message::<Self, _>(bytes, |r| {
            let vote = r.vote("vote")?;
            let snapshot_id = r.str("the snapshot id")?;
            let file = r.u32("the file")?;
            let offset = r.u64("the offset")?;
            let crc = r.u32("the crc")?;
            let len = r.u32("the chunk's length")? as usize;
            let bytes = r.take(len, "the chunk")?.to_vec();
            Ok(SnapshotChunk {
                vote,
                snapshot_id,
                file,
                offset,
                crc,
                bytes,
            })
        })
    }
}

impl Wire for ChunkTaken {
    const MESSAGE: u8 = SNAPSHOT_CHUNK | ANSWER;
    const NAME: &'static str = "a snapshot chunk's answer";

    fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = header::<Self>(8);
        out.extend_from_slice(&self.have.to_le_bytes());
        Ok(out)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        Reader::message::<Self, _>(bytes, |r| {
            Ok(ChunkTaken {
                have: r.u64("the bytes held")?,
            })
        })
    }
}

impl Wire for SnapshotInstall {
    const MESSAGE: u8 = SNAPSHOT_INSTALL;
    const NAME: &'static str = "a snapshot install request";

    fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = header::<Self>(VOTE_LEN + 2 + self.snapshot_id.len());
        put_vote(&mut out, &self.vote);
        put_str(&mut out, &self.snapshot_id)?;
        Ok(out)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        Reader::message::<Self, _>(bytes, |r| {
            Ok(SnapshotInstall {
                vote: r.vote("vote")?,
                snapshot_id: r.str("the snapshot id")?,
            })
        })
    }
}

impl Wire for SnapshotResponse<u64> {
    const MESSAGE: u8 = SNAPSHOT_INSTALL | ANSWER;
    const NAME: &'static str = "a snapshot install answer";

    fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = header::<Self>(VOTE_LEN);
        put_vote(&mut out, &self.vote);
        Ok(out)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        Reader::message::<Self, _>(bytes, |r| {
            Ok(SnapshotResponse {
                vote: r.vote("vote")?,
            })
        })
    }
}

/// A buffer holding `M`'s header, with room for a body of `body_len` bytes.
fn header<M: Wire>(body_len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + body_len);
    out.push(VERSION);
    out.push(M::MESSAGE);
    out
}

fn opt_log_id_len(log_id: &Option<LogId<u64>>) -> usize {
    match log_id {
        None => 1,
        Some(_) => 1 + LOG_ID_LEN,
    }
}

fn put_len(out: &mut Vec<u8>, what: &'static str, len: usize) -> Result<(), EncodeError> {
    let len32 = u32::try_from(len).map_err(|_| EncodeError::TooLarge { what, len })?;
    out.extend_from_slice(&len32.to_le_bytes());
    Ok(())
}

fn put_str(out: &mut Vec<u8>, text: &str) -> Result<(), EncodeError> {
    let len = u16::try_from(text.len()).map_err(|_| EncodeError::TooLarge {
        what: "a string",
        len: text.len(),
    })?;
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(text.as_bytes());
    Ok(())
}

fn put_log_id(out: &mut Vec<u8>, log_id: &LogId<u64>) {
    out.extend_from_slice(&log_id.leader_id.term.to_le_bytes());
    out.extend_from_slice(&log_id.leader_id.node_id.to_le_bytes());
    out.extend_from_slice(&log_id.index.to_le_bytes());
}

fn put_opt_log_id(out: &mut Vec<u8>, log_id: Option<&LogId<u64>>) {
    match log_id {
        None => out.push(0),
        Some(log_id) => {
            out.push(1);
            put_log_id(out, log_id);
        }
    }
}

fn put_vote(out: &mut Vec<u8>, vote: &Vote<u64>) {
    out.extend_from_slice(&vote.leader_id.term.to_le_bytes());
    out.extend_from_slice(&vote.leader_id.node_id.to_le_bytes());
    out.push(u8::from(vote.committed));
}

/// Reads one message, every read checked against what remains.
struct Reader<'a> {
    bytes: &'a [u8],
    /// The offset of the next byte to read; never past the end.
    at: usize,
    message: &'static str,
}

impl<'a> Reader<'a> {
    /// The message `M` in `bytes`: its header checked, its body read by `body`, nothing after it.
    fn message<M: Wire, F>(bytes: &'a [u8], body: F) -> Result<M, DecodeError>
    where
        F: FnOnce(&mut Reader<'a>) -> Result<M, DecodeError>,
    {
        let mut r = Reader {
            bytes,
            at: 0,
            message: M::NAME,
        };
        let found = r.u8("the version")?;
        if found != VERSION {
            return Err(r.error(0, Problem::Version { found }));
        }
        let found = r.u8("the message")?;
        if found != M::MESSAGE {
            let expected = M::MESSAGE;
            return Err(r.error(1, Problem::Message { found, expected }));
        }
        let message = body(&mut r)?;
        match r.remaining() {
            0 => Ok(message),
            len => Err(r.error(r.at, Problem::Trailing { len })),
        }
    }

    fn error(&self, offset: usize, problem: Problem) -> DecodeError {
        DecodeError {
            message: self.message,
            offset,
            problem,
        }
    }

    fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.at)
    }

    /// The next `len` bytes.
    fn take(&mut self, len: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        let end = self.at.checked_add(len);
        match end.and_then(|end| self.bytes.get(self.at..end)) {
            Some(taken) => {
                self.at += len;
                Ok(taken)
            }
            None => Err(self.error(
                self.at,
                Problem::Truncated {
                    what,
                    needed: len,
                    remaining: self.remaining(),
                },
            )),
        }
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], DecodeError> {
        let taken = self.take(N, what)?;
        let mut array = [0u8; N];
        array.copy_from_slice(taken);
        Ok(array)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn str(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let len = u16::from_le_bytes(self.array(what)?) as usize;
        let at = self.at;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.error(at, Problem::NotUtf8 { what }))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A byte that must be 0 or 1.
    fn flag(&mut self, what: &'static str) -> Result<bool, DecodeError> {
        let at = self.at;
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            found => Err(self.error(
                at,
                Problem::Invalid {
                    what,
                    found,
                    valid: "0, 1",
                },
            )),
        }
    }

    fn log_id(&mut self, what: &'static str) -> Result<LogId<u64>, DecodeError> {
        // One read for the whole log id: a truncated one is reported where it begins.
        let bytes = self.array::<LOG_ID_LEN>(what)?;
        let word = |i: usize| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
            u64::from_le_bytes(word)
        };
        Ok(LogId::new(LeaderId::new(word(0), word(1)), word(2)))
    }

    fn opt_log_id(&mut self, what: &'static str) -> Result<Option<LogId<u64>>, DecodeError> {
        match self.flag(what)? {
            false => Ok(None),
            true => self.log_id(what).map(Some),
        }
    }

    fn vote(&mut self, what: &'static str) -> Result<Vote<u64>, DecodeError> {
        let term = self.u64(what)?;
        let node_id = self.u64(what)?;
        let committed = self.flag("a vote's committed flag")?;
        Ok(Vote {
            leader_id: LeaderId::new(term, node_id),
            committed,
        })
    }

    fn entry(&mut self) -> Result<Entry<TypeConfig>, DecodeError> {
        let log_id = self.log_id("an entry's log id")?;
        let at = self.at;
        let payload = match self.u8("an entry's payload")? {
            PAYLOAD_BLANK => EntryPayload::Blank,
            PAYLOAD_NORMAL => {
                let len = self.u32("a proposal's length")? as usize;
                let frames = self.take(len, "a proposal's frames")?.to_vec();
                EntryPayload::Normal(Proposal { frames })
            }
            PAYLOAD_MEMBERSHIP => {
                let len = self.u32("a membership's length")? as usize;
                let json_at = self.at;
                let json = self.take(len, "a membership")?;
                let membership = membership(json)
                    .map_err(|why| self.error(json_at, Problem::Membership { why }))?;
                EntryPayload::Membership(membership)
            }
            found => {
                return Err(self.error(
                    at,
                    Problem::Invalid {
                        what: "an entry's payload",
                        found,
                        valid: "0 (blank), 1 (normal), 2 (membership)",
                    },
                ))
            }
        };
        Ok(Entry { log_id, payload })
    }
}

/// A membership from its JSON, valid as openraft makes them (see the invariants above).
fn membership(json: &[u8]) -> Result<Membership<u64, Member>, String> {
    let membership: Membership<u64, Member> =
        serde_json::from_slice(json).map_err(|e| e.to_string())?;
    if membership.get_joint_config().is_empty() {
        return Err("no config of voters".into());
    }
    if let Some(voter) = membership
        .voter_ids()
        .find(|id| membership.get_node(id).is_none())
    {
        return Err(format!("voter {voter} has no node"));
    }
    Ok(membership)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, BTreeSet};

    fn log_id() -> impl Strategy<Value = LogId<u64>> {
        (any::<u64>(), any::<u64>(), any::<u64>())
            .prop_map(|(term, node, index)| LogId::new(LeaderId::new(term, node), index))
    }

    fn vote() -> impl Strategy<Value = Vote<u64>> {
        (any::<u64>(), any::<u64>(), any::<bool>()).prop_map(|(term, node, committed)| Vote {
            leader_id: LeaderId::new(term, node),
            committed,
        })
    }

    fn membership() -> impl Strategy<Value = Membership<u64, Member>> {
        let member =
            ("[a-z0-9:/.]{0,24}", "[a-z0-9:.]{0,24}").prop_map(|(api, peer)| Member { api, peer });
        proptest::collection::btree_map(0u64..16, member, 1..6)
            .prop_flat_map(|nodes| {
                let ids: Vec<u64> = nodes.keys().copied().collect();
                let config = proptest::sample::subsequence(ids.clone(), 1..=ids.len())
                    .prop_map(|ids| ids.into_iter().collect::<BTreeSet<u64>>());
                (proptest::collection::vec(config, 1..=2), Just(nodes))
            })
            .prop_map(
                |(configs, nodes): (Vec<BTreeSet<u64>>, BTreeMap<u64, Member>)| {
                    Membership::new(configs, nodes)
                },
            )
    }

    fn entry() -> impl Strategy<Value = Entry<TypeConfig>> {
        let payload = prop_oneof![
            Just(EntryPayload::Blank),
            proptest::collection::vec(any::<u8>(), 0..512)
                .prop_map(|frames| EntryPayload::Normal(Proposal { frames })),
            membership().prop_map(EntryPayload::Membership),
        ];
        (log_id(), payload).prop_map(|(log_id, payload)| Entry { log_id, payload })
    }

    fn vote_request() -> impl Strategy<Value = VoteRequest<u64>> {
        (vote(), proptest::option::of(log_id()))
            .prop_map(|(vote, last_log_id)| VoteRequest { vote, last_log_id })
    }

    fn vote_response() -> impl Strategy<Value = VoteResponse<u64>> {
        (vote(), any::<bool>(), proptest::option::of(log_id())).prop_map(
            |(vote, vote_granted, last_log_id)| VoteResponse {
                vote,
                vote_granted,
                last_log_id,
            },
        )
    }

    fn append_request() -> impl Strategy<Value = AppendEntriesRequest<TypeConfig>> {
        (
            vote(),
            proptest::option::of(log_id()),
            proptest::option::of(log_id()),
            proptest::collection::vec(entry(), 0..8),
        )
            .prop_map(
                |(vote, prev_log_id, leader_commit, entries)| AppendEntriesRequest {
                    vote,
                    prev_log_id,
                    leader_commit,
                    entries,
                },
            )
    }

    /// (`AppendEntriesResponse` is not `Clone`, which `Just` needs: drawn from a tag.)
    fn append_response() -> impl Strategy<Value = AppendEntriesResponse<u64>> {
        (0u8..4, proptest::option::of(log_id()), vote()).prop_map(|(outcome, matching, vote)| {
            match outcome {
                0 => AppendEntriesResponse::Success,
                1 => AppendEntriesResponse::PartialSuccess(matching),
                2 => AppendEntriesResponse::Conflict,
                _ => AppendEntriesResponse::HigherVote(vote),
            }
        })
    }

    /// `AppendEntriesRequest` has no `PartialEq`: compared field by field.
    fn same_append(
        a: &AppendEntriesRequest<TypeConfig>,
        b: &AppendEntriesRequest<TypeConfig>,
    ) -> bool {
        a.vote == b.vote
            && a.prev_log_id == b.prev_log_id
            && a.leader_commit == b.leader_commit
            && a.entries == b.entries
    }

    /// Every cut of a valid encoding is an error that says it ran out of bytes (or, where a count of
    /// entries is read, that they cannot fit in what remains); so is the encoding with bytes after it.
    fn assert_cuts_and_tails_refused<M: Wire + std::fmt::Debug>(bytes: &[u8]) {
        for cut in 0..bytes.len() {
            match M::decode(&bytes[..cut]) {
                Err(DecodeError {
                    problem: Problem::Truncated { .. } | Problem::TooManyEntries { .. },
                    offset,
                    ..
                }) => assert!(offset <= cut, "an offset past the cut at {cut}: {offset}"),
                other => panic!("{} cut at {cut} of {}: {other:?}", M::NAME, bytes.len()),
            }
        }
        let mut longer = bytes.to_vec();
        longer.push(0);
        assert_eq!(
            M::decode(&longer).unwrap_err().problem,
            Problem::Trailing { len: 1 }
        );
    }

    /// Whatever the bytes, decoding each message returns, with an error or a message.
    fn decode_all(bytes: &[u8]) {
        let _ = VoteRequest::<u64>::decode(bytes);
        let _ = VoteResponse::<u64>::decode(bytes);
        let _ = AppendEntriesRequest::<TypeConfig>::decode(bytes);
        let _ = AppendEntriesResponse::<u64>::decode(bytes);
        let _ = SnapshotOffer::decode(bytes);
        let _ = SnapshotHave::decode(bytes);
        let _ = SnapshotChunk::decode(bytes);
        let _ = ChunkTaken::decode(bytes);
        let _ = SnapshotInstall::decode(bytes);
        let _ = SnapshotResponse::<u64>::decode(bytes);
    }

    fn snapshot_offer() -> impl Strategy<Value = SnapshotOffer> {
        let files = proptest::collection::vec(("[a-z/.]{0,40}", any::<u64>()), 0..8);
        (
            vote(),
            proptest::option::of(log_id()),
            membership(),
            log_id(),
            "[0-9a-z-]{0,40}",
            files,
        )
            .prop_map(
                |(vote, last, membership, at, snapshot_id, files)| SnapshotOffer {
                    vote,
                    meta: SnapshotMeta {
                        last_log_id: last,
                        last_membership: openraft::StoredMembership::new(Some(at), membership),
                        snapshot_id,
                    },
                    files,
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn vote_requests_round_trip(request in vote_request()) {
            let bytes = request.encode().unwrap();
            prop_assert_eq!(VoteRequest::decode(&bytes).unwrap(), request);
            assert_cuts_and_tails_refused::<VoteRequest<u64>>(&bytes);
        }

        #[test]
        fn vote_answers_round_trip(answer in vote_response()) {
            let bytes = answer.encode().unwrap();
            prop_assert_eq!(VoteResponse::decode(&bytes).unwrap(), answer);
            assert_cuts_and_tails_refused::<VoteResponse<u64>>(&bytes);
        }

        #[test]
        fn append_requests_round_trip(request in append_request()) {
            let bytes = request.encode().unwrap();
            let decoded = AppendEntriesRequest::<TypeConfig>::decode(&bytes).unwrap();
            prop_assert!(same_append(&decoded, &request), "{decoded:?} != {request:?}");
            assert_cuts_and_tails_refused::<AppendEntriesRequest<TypeConfig>>(&bytes);
        }

        #[test]
        fn append_answers_round_trip(answer in append_response()) {
            let bytes = answer.encode().unwrap();
            prop_assert_eq!(AppendEntriesResponse::decode(&bytes).unwrap(), answer);
            assert_cuts_and_tails_refused::<AppendEntriesResponse<u64>>(&bytes);
        }

        #[test]
        fn snapshot_messages_round_trip(
            offer in snapshot_offer(),
            have in proptest::collection::vec(any::<u64>(), 0..8),
            (file, offset, crc) in (any::<u32>(), any::<u64>(), any::<u32>()),
            bytes in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let encoded = offer.encode().unwrap();
            prop_assert_eq!(SnapshotOffer::decode(&encoded).unwrap(), offer.clone());
            assert_cuts_and_tails_refused::<SnapshotOffer>(&encoded);
            let answer = SnapshotHave { have };
            let encoded = answer.encode().unwrap();
            prop_assert_eq!(SnapshotHave::decode(&encoded).unwrap(), answer);
            assert_cuts_and_tails_refused::<SnapshotHave>(&encoded);
            let snapshot_id = offer.meta.snapshot_id.clone();
            let chunk = SnapshotChunk { vote: offer.vote, snapshot_id: snapshot_id.clone(), file, offset, crc, bytes };
            let encoded = chunk.encode().unwrap();
            prop_assert_eq!(SnapshotChunk::decode(&encoded).unwrap(), chunk);
            assert_cuts_and_tails_refused::<SnapshotChunk>(&encoded);
            let taken = ChunkTaken { have: offset };
            prop_assert_eq!(ChunkTaken::decode(&taken.encode().unwrap()).unwrap(), taken);
            let install = SnapshotInstall { vote: offer.vote, snapshot_id };
            let encoded = install.encode().unwrap();
            prop_assert_eq!(SnapshotInstall::decode(&encoded).unwrap(), install);
            assert_cuts_and_tails_refused::<SnapshotInstall>(&encoded);
            let response = SnapshotResponse { vote: offer.vote };
            let encoded = response.encode().unwrap();
            prop_assert_eq!(SnapshotResponse::<u64>::decode(&encoded).unwrap(), response);
        }

        #[test]
        fn any_bytes_decode_without_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            decode_all(&bytes);
        }

        /// Random bodies behind a valid header get past it, into the fields' checks.
        #[test]
        fn any_body_decodes_without_panic(
            message in prop_oneof![
                Just(VOTE), Just(APPEND), Just(VOTE | ANSWER), Just(APPEND | ANSWER),
                Just(SNAPSHOT_OFFER), Just(SNAPSHOT_OFFER | ANSWER), Just(SNAPSHOT_CHUNK),
                Just(SNAPSHOT_CHUNK | ANSWER), Just(SNAPSHOT_INSTALL), Just(SNAPSHOT_INSTALL | ANSWER),
            ],
            body in proptest::collection::vec(any::<u8>(), 0..256),
        ) {
            let bytes = [&[VERSION, message][..], &body].concat();
            decode_all(&bytes);
        }

        /// Flipped bytes in a valid request: an error or some message, never a panic; the header's
        /// bytes are always caught.
        #[test]
        fn corrupted_requests_decode_without_panic(
            request in append_request(),
            flips in proptest::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 1..4),
        ) {
            let mut bytes = request.encode().unwrap();
            for (at, xor) in flips {
                let at = at.index(bytes.len());
                bytes[at] ^= xor;
                if at < HEADER_LEN {
                    prop_assert!(AppendEntriesRequest::<TypeConfig>::decode(&bytes).is_err());
                }
            }
            decode_all(&bytes);
        }
    }

    #[test]
    fn a_vote_request_is_laid_out_as_documented() {
        let request = VoteRequest {
            vote: Vote {
                leader_id: LeaderId::new(7, 2),
                committed: false,
            },
            last_log_id: Some(LogId::new(LeaderId::new(6, 1), 9312)),
        };
        let mut expected = vec![VERSION, VOTE];
        expected.extend_from_slice(&7u64.to_le_bytes());
        expected.extend_from_slice(&2u64.to_le_bytes());
        expected.push(0);
        expected.push(1);
        expected.extend_from_slice(&6u64.to_le_bytes());
        expected.extend_from_slice(&1u64.to_le_bytes());
        expected.extend_from_slice(&9312u64.to_le_bytes());
        assert_eq!(request.encode().unwrap(), expected);
    }

    #[test]
    fn a_proposal_travels_as_its_bytes_behind_its_length() {
        let request = AppendEntriesRequest::<TypeConfig> {
            vote: Vote::default(),
            prev_log_id: None,
            leader_commit: None,
            entries: vec![Entry {
                log_id: LogId::new(LeaderId::new(3, 1), 5),
                payload: EntryPayload::Normal(Proposal {
                    frames: b"frames".to_vec(),
                }),
            }],
        };
        let bytes = request.encode().unwrap();
        let mut tail = 1u32.to_le_bytes().to_vec();
        for word in [3u64, 1, 5] {
            tail.extend_from_slice(&word.to_le_bytes());
        }
        tail.push(PAYLOAD_NORMAL);
        tail.extend_from_slice(&6u32.to_le_bytes());
        tail.extend_from_slice(b"frames");
        assert_eq!(bytes.len(), HEADER_LEN + VOTE_LEN + 2 + tail.len());
        assert!(bytes.ends_with(&tail), "{bytes:?}");
        assert_eq!(bytes.capacity(), bytes.len(), "sized once");
    }

    #[test]
    fn another_version_or_message_is_refused() {
        let request = VoteRequest::<u64> {
            vote: Vote::default(),
            last_log_id: None,
        };
        let mut bytes = request.encode().unwrap();
        assert_eq!(
            VoteResponse::<u64>::decode(&bytes).unwrap_err(),
            DecodeError {
                message: "a vote answer",
                offset: 1,
                problem: Problem::Message {
                    found: VOTE,
                    expected: VOTE | ANSWER
                },
            }
        );
        let as_append = AppendEntriesRequest::<TypeConfig>::decode(&bytes).unwrap_err();
        assert_eq!(
            as_append.to_string(),
            "an append-entries request at byte 1: message 0x01, not 0x02"
        );
        bytes[0] = VERSION + 1;
        assert_eq!(
            VoteRequest::<u64>::decode(&bytes).unwrap_err().problem,
            Problem::Version { found: VERSION + 1 }
        );
    }

    #[test]
    fn a_count_of_entries_past_the_bytes_is_refused_before_allocating() {
        let mut bytes = vec![VERSION, APPEND];
        bytes.extend_from_slice(&[0u8; VOTE_LEN]);
        bytes.extend_from_slice(&[0, 0]);
        bytes.extend_from_slice(&u32::MAX.to_le_bytes());
        bytes.extend_from_slice(&[0u8; MIN_ENTRY_LEN]);
        let error = AppendEntriesRequest::<TypeConfig>::decode(&bytes).unwrap_err();
        assert_eq!(error.offset, HEADER_LEN + VOTE_LEN + 2);
        assert_eq!(
            error.problem,
            Problem::TooManyEntries {
                count: u32::MAX,
                remaining: MIN_ENTRY_LEN
            }
        );
        // A proposal's length past the end is a truncation, found where its frames would begin.
        let mut bytes = vec![VERSION, APPEND];
        bytes.extend_from_slice(&[0u8; VOTE_LEN]);
        bytes.extend_from_slice(&[0, 0]);
        bytes.extend_from_slice(&1u32.to_le_bytes());
        bytes.extend_from_slice(&[0u8; LOG_ID_LEN]);
        bytes.push(PAYLOAD_NORMAL);
        bytes.extend_from_slice(&u32::MAX.to_le_bytes());
        let error = AppendEntriesRequest::<TypeConfig>::decode(&bytes).unwrap_err();
        assert_eq!(error.offset, bytes.len());
        assert!(
            error
                .to_string()
                .contains("a proposal's frames needs 4294967295 bytes, 0 remain"),
            "{error}"
        );
    }

    #[test]
    fn flags_and_tags_take_only_their_values() {
        let answer = VoteResponse::<u64> {
            vote: Vote::default(),
            vote_granted: true,
            last_log_id: None,
        };
        let mut bytes = answer.encode().unwrap();
        bytes[HEADER_LEN + VOTE_LEN] = 2;
        assert_eq!(
            VoteResponse::<u64>::decode(&bytes).unwrap_err().to_string(),
            "a vote answer at byte 19: granted 2 is none of 0, 1"
        );
        let mut bytes = AppendEntriesResponse::<u64>::Conflict.encode().unwrap();
        bytes[HEADER_LEN] = 4;
        assert!(matches!(
            AppendEntriesResponse::<u64>::decode(&bytes)
                .unwrap_err()
                .problem,
            Problem::Invalid { found: 4, .. }
        ));
    }

    #[test]
    fn a_membership_without_the_nodes_of_its_voters_is_refused() {
        let entry_with = |json: &[u8]| {
            let mut bytes = vec![VERSION, APPEND];
            bytes.extend_from_slice(&[0u8; VOTE_LEN]);
            bytes.extend_from_slice(&[0, 0]);
            bytes.extend_from_slice(&1u32.to_le_bytes());
            bytes.extend_from_slice(&[0u8; LOG_ID_LEN]);
            bytes.push(PAYLOAD_MEMBERSHIP);
            bytes.extend_from_slice(&(json.len() as u32).to_le_bytes());
            bytes.extend_from_slice(json);
            AppendEntriesRequest::<TypeConfig>::decode(&bytes)
        };
        let valid = br#"{"configs":[[1]],"nodes":{"1":{"api":"a","peer":"p"}}}"#;
        assert!(entry_with(valid).is_ok());
        for (json, why) in [
            (
                &br#"{"configs":[[1,2]],"nodes":{"1":{"api":"a","peer":"p"}}}"#[..],
                "voter 2 has no node",
            ),
            (br#"{"configs":[],"nodes":{}}"#, "no config of voters"),
            (b"{", "EOF while parsing"),
        ] {
            let error = entry_with(json).unwrap_err();
            assert_eq!(
                error.offset,
                HEADER_LEN + VOTE_LEN + 2 + 4 + MIN_ENTRY_LEN + 4
            );
            assert!(error.to_string().contains(why), "{error}");
        }
    }

    #[test]
    fn a_raft_error_travels_as_json() {
        let error: RaftError<u64> = RaftError::Fatal(openraft::error::Fatal::Stopped);
        let text = raft_error_text(&error);
        assert_eq!(raft_error_from_text(&text), Some(error));
        assert_eq!(raft_error_from_text("no answer within 5s"), None);
    }
}
