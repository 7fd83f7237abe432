//! Raft's RPCs between members: sent by [`PeerNetwork`] (openraft's network) and answered by
//! [`RaftService`], over the peer link (peer.rs) in the codec of rpc.rs.
//!
//! How a failed call reaches openraft. openraft 0.9.25 backs off ([`RaftNetwork::backoff`], 500 ms by
//! default) only after `Unreachable`; after `Timeout`, `Network` or `RemoteError` it reports the
//! failure and tries again at its next heartbeat or election; after `PayloadTooLarge` it sends fewer
//! entries at once, at once. So:
//!
//! ```text
//! the member's peer address does not resolve                Unreachable      back off, retry
//! connection refused, host or network unreachable           Unreachable      back off, retry
//! the handshake refused (another secret, version, id)       Unreachable      back off, retry
//! a deadline passed: the RPC's hard TTL, or the link's      Timeout          retry at the next tick
//!   connect / handshake / request timeout
//! any other I/O error (a reset, a close within the call)    Network          retry: the next call
//!                                                                            connects again
//! an undecodable answer, an error text that is not a        Network          retry
//!   RaftError (a request the member could not take)
//! the member's RaftError                                    RemoteError
//! an append of several entries over max_frame_bytes         PayloadTooLarge  half the entries
//! one entry over max_frame_bytes                            Unreachable      back off, retry (it
//!                                                                            never fits: logged)
//! a snapshot: any failure of its offer, chunks or install   as above; a      openraft sends it
//!   (sent by `send_snapshot`, received by snapshot.rs)       cut transfer     again, from where
//!                                                           resumes          the member is
//! ```
//!
//! Invariants:
//! - One [`PeerClient`] a member, shared by every client openraft asks for (it asks for one each
//!   election and each replication stream), so that they share its few pooled connections. It is made
//!   on the first call, never in [`RaftNetworkFactory::new_client`], which openraft awaits on its core
//!   task: a name is resolved on the call's own time.
//! - A call ends by the RPC's hard TTL ([`RPCOption::hard_ttl`]: openraft drops it then anyway) and by
//!   the link's own limits, whichever comes first: `PeerOptions::connect_timeout` and
//!   `handshake_timeout` for a new connection, `request_timeout` for the exchange. The TTLs are the
//!   heartbeat interval for appends and `election_timeout_min` for votes, so `request_timeout` longer
//!   than both leaves the TTL in charge. A call cut by the TTL drops its connection (the peer link
//!   never pools a connection whose call did not end cleanly).
//! - A member whose peer address is a name is resolved again after a call to it failed on the link,
//!   for a member that restarted elsewhere under the same name; a literal address is kept.
//! - [`RaftService`] answers a vote or an append only if the authenticated caller is the member the
//!   vote names (the candidate, or the leader): a member cannot speak for another.

use super::handoff::Handoff;
use super::rejoin::Rejoin;
use super::rpc::{
    self, ChunkTaken, DecodeError, EncodeError, SnapshotChunk, SnapshotHave, SnapshotInstall,
    SnapshotOffer, Wire, APPEND, SNAPSHOT_CHUNK, SNAPSHOT_INSTALL, SNAPSHOT_OFFER, VOTE,
};
use super::snapshot::{Received, SnapshotFiles, Snapshots};
use super::{Member, TypeConfig};
use crate::peer::{PeerClient, PeerError, PeerOptions, PeerService, MIN_SECRET_BYTES};
use futures_core::future::BoxFuture;
use openraft::error::{
    Fatal, NetworkError, PayloadTooLarge, RPCError, RaftError, RemoteError, ReplicationClosed,
    StreamingError, Timeout, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::{OptionalSend, RPCTypes, Snapshot, Vote};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// `cluster.secret`, kept out of `Debug` output.
#[derive(Clone)]
struct Secret(Arc<str>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// openraft's network: this member's clients of the others, one [`PeerClient`] each.
#[derive(Debug)]
pub struct PeerNetwork {
    /// This member's id, which the members it calls are told.
    id: u64,
    secret: Secret,
    options: PeerOptions,
    /// By member id; replaced when a member's peer address changes.
    links: HashMap<u64, Arc<MemberLink>>,
    /// When each member last answered a call.
    answers: Answers,
}

/// When each member last answered one of this member's calls (any answer, an error from its Raft
/// too: it was reached). Shared with whoever reports the cluster's state (`GET /v1/cluster`).
#[derive(Debug, Clone, Default)]
pub struct Answers(Arc<Mutex<HashMap<u64, std::time::Instant>>>);

impl Answers {
    /// When member `id` last answered; `None` if it never did.
    pub fn last(&self, id: u64) -> Option<std::time::Instant> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .copied()
    }

    fn record(&self, id: u64) {
        let now = std::time::Instant::now();
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, now);
    }
}

impl PeerNetwork {
    /// The network of member `id`, calling the others with `secret` within `options`. Refuses a
    /// secret shorter than [`MIN_SECRET_BYTES`] here rather than at the first call.
    pub fn new(id: u64, secret: &str, options: PeerOptions) -> Result<PeerNetwork, PeerError> {
        if secret.len() < MIN_SECRET_BYTES {
            return Err(PeerError::WeakSecret);
        }
        Ok(PeerNetwork {
            id,
            secret: Secret(secret.into()),
            options,
            links: HashMap::new(),
            answers: Answers::default(),
        })
    }

    /// When each member last answered this network's calls.
    pub fn answers(&self) -> Answers {
        self.answers.clone()
    }
}

impl RaftNetworkFactory<TypeConfig> for PeerNetwork {
    type Network = MemberClient;

    async fn new_client(&mut self, target: u64, node: &Member) -> MemberClient {
        let link = match self.links.get(&target) {
            Some(link) if link.peer == node.peer => link.clone(),
            _ => {
                let link = Arc::new(MemberLink {
                    id: self.id,
                    target,
                    peer: node.peer.clone(),
                    secret: self.secret.clone(),
                    options: self.options.clone(),
                    client: Mutex::new(None),
                    answers: self.answers.clone(),
                    failures: Mutex::default(),
                });
                self.links.insert(target, link.clone());
                link
            }
        };
        MemberClient {
            link,
            member: node.clone(),
        }
    }
}

/// One member's peer address and the client that calls it.
#[derive(Debug)]
struct MemberLink {
    id: u64,
    target: u64,
    /// As the membership has it: `host:port`, an IP or a name.
    peer: String,
    secret: Secret,
    options: PeerOptions,
    /// Made on the first call; forgotten after a failure when `peer` is a name.
    client: Mutex<Option<Arc<PeerClient>>>,
    answers: Answers,
    /// Calls that failed in a row, and when the last one did.
    failures: Mutex<(u32, Option<tokio::time::Instant>)>,
}

/// The pause before a call to a member whose last calls failed: 5 ms, doubling with each failure in a
/// row up to this. openraft backs off only from members it finds unreachable; one that accepts links
/// and closes them (a proxy in front of a stopped member, a stuck process) would be called again at
/// once, thousands of times a second.
const FAILED_CALLS_PAUSE_MAX: Duration = Duration::from_millis(100);

impl MemberLink {
    fn slot(&self) -> MutexGuard<'_, Option<Arc<PeerClient>>> {
        self.client.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn client(&self) -> Result<Arc<PeerClient>, CallError> {
        if let Some(client) = self.slot().as_ref() {
            return Ok(client.clone());
        }
        let addr = match self.peer.parse::<SocketAddr>() {
            Ok(addr) => addr,
            Err(_) => self.resolve().await?,
        };
        let client = PeerClient::new(
            addr,
            self.id,
            self.target,
            &self.secret.0,
            self.options.clone(),
        )?;
        // Two first calls at once may both get here: the first one's client is kept.
        Ok(self.slot().get_or_insert(Arc::new(client)).clone())
    }

    async fn resolve(&self) -> Result<SocketAddr, CallError> {
        let resolve = |source| CallError::Resolve {
            peer: self.peer.clone(),
            source,
        };
        let mut addrs = tokio::net::lookup_host(self.peer.as_str())
            .await
            .map_err(resolve)?;
        addrs
            .next()
            .ok_or_else(|| resolve(std::io::ErrorKind::NotFound.into()))
    }

    /// Forgets `client` after a failure on the link, so that the next call resolves the name again.
    fn forget(&self, client: &Arc<PeerClient>) {
        if self.peer.parse::<SocketAddr>().is_ok() {
            return;
        }
        let mut slot = self.slot();
        if slot.as_ref().is_some_and(|held| Arc::ptr_eq(held, client)) {
            *slot = None;
        }
    }

    /// Sends `request` as a request of `kind` and decodes its answer, all within `ttl`.
    async fn call<Q: Wire, A: Wire>(
        &self,
        kind: u8,
        request: &Q,
        ttl: Duration,
    ) -> Result<A, CallError> {
        let deadline = tokio::time::Instant::now() + ttl;
        let payload = request.encode()?;
        let pause_until = {
            let (failed, last) = *self.failures.lock().unwrap_or_else(|p| p.into_inner());
            let pause = Duration::from_millis(5)
                .saturating_mul(1 << failed.saturating_sub(1).min(10))
                .min(FAILED_CALLS_PAUSE_MAX);
            last.filter(|_| failed > 0).map(|at| at + pause)
        };
        if let Some(until) = pause_until {
            tokio::time::sleep_until(until.min(deadline)).await;
        }
        let result = self.exchange(kind, &payload, ttl, deadline).await;
        let mut failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        *failures = match &result {
            Ok(_) | Err(CallError::Peer(PeerError::Answered { .. })) => (0, None),
            Err(_) => (
                failures.0.saturating_add(1),
                Some(tokio::time::Instant::now()),
            ),
        };
        drop(failures);
        Ok(A::decode(&result?)?)
    }

    /// One call's exchange: `payload` sent as a request of `kind`, its answer's bytes.
    async fn exchange(
        &self,
        kind: u8,
        payload: &[u8],
        ttl: Duration,
        deadline: tokio::time::Instant,
    ) -> Result<Vec<u8>, CallError> {
        let client = tokio::time::timeout_at(deadline, self.client())
            .await
            .map_err(|_| CallError::Deadline { after: ttl })??;
        let answered = tokio::time::timeout_at(deadline, client.call(kind, payload)).await;
        let answer = match answered {
            Ok(Ok(answer)) => answer,
            Ok(Err(error @ PeerError::Answered { .. })) => {
                self.answers.record(self.target);
                return Err(CallError::Peer(error));
            }
            Ok(Err(error)) => {
                if let PeerError::Io { .. }
                | PeerError::Timeout { .. }
                | PeerError::Refused { .. } = error
                {
                    self.forget(&client);
                }
                return Err(CallError::Peer(error));
            }
            Err(_) => {
                self.forget(&client);
                return Err(CallError::Deadline { after: ttl });
            }
        };
        self.answers.record(self.target);
        Ok(answer)
    }
}

/// Why a call to a member failed, before it is told to openraft as one of its `RPCError`s.
#[derive(Debug, thiserror::Error)]
enum CallError {
    #[error("the peer address {peer:?} does not resolve: {source}")]
    Resolve {
        peer: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Peer(#[from] PeerError),
    #[error("no answer within the RPC's {after:?}")]
    Deadline { after: Duration },
    #[error("the request cannot be encoded: {0}")]
    Encode(#[from] EncodeError),
    #[error("the answer cannot be decoded: {0}")]
    Decode(#[from] DecodeError),
    /// A snapshot's file could not be read here, or the member kept refusing a chunk.
    #[error("the snapshot cannot be sent: {0}")]
    Snapshot(String),
}

/// What openraft is to make of a [`CallError`] (the table atop this module).
enum Verdict {
    Unreachable,
    Timeout(Duration),
    Network,
    Remote(Box<RaftError<u64>>),
    TooLarge,
}

impl CallError {
    fn verdict(&self) -> Verdict {
        match self {
            CallError::Peer(PeerError::Answered { text, .. }) => {
                match rpc::raft_error_from_text(text) {
                    Some(error) => Verdict::Remote(Box::new(error)),
                    None => Verdict::Network,
                }
            }
            CallError::Peer(PeerError::Timeout { after, .. }) | CallError::Deadline { after } => {
                Verdict::Timeout(*after)
            }
            CallError::Peer(PeerError::Io { source, .. }) => match source.kind() {
                std::io::ErrorKind::ConnectionRefused
                | std::io::ErrorKind::HostUnreachable
                | std::io::ErrorKind::NetworkUnreachable
                | std::io::ErrorKind::NetworkDown
                | std::io::ErrorKind::AddrNotAvailable => Verdict::Unreachable,
                _ => Verdict::Network,
            },
            CallError::Peer(PeerError::TooLarge { .. })
            | CallError::Encode(EncodeError::TooLarge { .. }) => Verdict::TooLarge,
            CallError::Resolve { .. }
            | CallError::Peer(PeerError::Refused { .. } | PeerError::WeakSecret)
            | CallError::Encode(EncodeError::Membership(_) | EncodeError::Meta(_)) => {
                Verdict::Unreachable
            }
            CallError::Decode(_) | CallError::Snapshot(_) => Verdict::Network,
        }
    }
}

/// openraft's client of one member: its RPCs go through the member's shared [`PeerClient`].
#[derive(Debug)]
pub struct MemberClient {
    link: Arc<MemberLink>,
    member: Member,
}

type RpcResult<T> = Result<T, RPCError<u64, Member, RaftError<u64>>>;

impl MemberClient {
    /// `error` as openraft's, for an RPC of `action` that carried `entries` entries.
    fn rpc_error(
        &self,
        action: RPCTypes,
        entries: usize,
        error: CallError,
    ) -> RPCError<u64, Member, RaftError<u64>> {
        let target = self.link.target;
        match error.verdict() {
            Verdict::Remote(source) => RPCError::RemoteError(RemoteError::new_with_node(
                target,
                self.member.clone(),
                *source,
            )),
            Verdict::Timeout(timeout) => RPCError::Timeout(Timeout {
                action,
                id: self.link.id,
                target,
                timeout,
            }),
            // Half as many entries at once; openraft keeps the hint for its next ten appends.
            Verdict::TooLarge if entries > 1 => {
                PayloadTooLarge::new_entries_hint((entries / 2) as u64)
                    .with_source_error(&error)
                    .into()
            }
            Verdict::TooLarge => {
                tracing::error!(member = target, %error, "a Raft entry does not fit in the peer link's max_frame_bytes");
                RPCError::Unreachable(Unreachable::new(&error))
            }
            Verdict::Unreachable => RPCError::Unreachable(Unreachable::new(&error)),
            Verdict::Network => RPCError::Network(NetworkError::new(&error)),
        }
    }
}

impl RaftNetwork<TypeConfig> for MemberClient {
    async fn append_entries(
        &mut self,
        request: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<u64>> {
        let entries = request.entries.len();
        self.link
            .call(APPEND, &request, option.hard_ttl())
            .await
            .map_err(|e| self.rpc_error(RPCTypes::AppendEntries, entries, e))
    }

    async fn vote(
        &mut self,
        request: VoteRequest<u64>,
        option: RPCOption,
    ) -> RpcResult<VoteResponse<u64>> {
        self.link
            .call(VOTE, &request, option.hard_ttl())
            .await
            .map_err(|e| self.rpc_error(RPCTypes::Vote, 0, e))
    }

    /// Streams the snapshot's files (`send_snapshot`); a failure is reported as the call's would be,
    /// and openraft sends it again later: the member's answer to the next offer says where to resume.
    async fn full_snapshot(
        &mut self,
        vote: Vote<u64>,
        snapshot: Snapshot<TypeConfig>,
        cancel: impl std::future::Future<Output = ReplicationClosed> + OptionalSend + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<u64>, StreamingError<TypeConfig, Fatal<u64>>> {
        let sent = tokio::select! {
            closed = cancel => return Err(StreamingError::Closed(closed)),
            sent = send_snapshot(&self.link, vote, snapshot) => sent,
        };
        sent.map_err(
            |error| match self.rpc_error(RPCTypes::InstallSnapshot, 0, error) {
                RPCError::Timeout(timeout) => StreamingError::Timeout(timeout),
                RPCError::Unreachable(unreachable) => StreamingError::Unreachable(unreachable),
                RPCError::PayloadTooLarge(too_large) => {
                    StreamingError::Network(NetworkError::new(&too_large))
                }
                RPCError::Network(network) => StreamingError::Network(network),
                RPCError::RemoteError(remote) => {
                    StreamingError::Network(NetworkError::new(&remote))
                }
            },
        )
    }
}

/// How long one call of a snapshot's transfer may take (a chunk is a megabyte).
const SNAPSHOT_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// A chunk refused this many times in a row (its CRC did not match on arrival) fails the transfer.
const CHUNK_REFUSALS: u32 = 5;

/// Sends `snapshot` to the member at the end of `link`: offers it (the member answers what it holds
/// of each file already), sends what it lacks a chunk at a time, then asks it to install it.
async fn send_snapshot(
    link: &MemberLink,
    vote: Vote<u64>,
    snapshot: Snapshot<TypeConfig>,
) -> Result<SnapshotResponse<u64>, CallError> {
    let Snapshot { meta, snapshot } = snapshot;
    let files: Arc<SnapshotFiles> = Arc::new(*snapshot);
    let started = std::time::Instant::now();
    let offer = SnapshotOffer {
        vote,
        meta: meta.clone(),
        files: files
            .files
            .iter()
            .map(|f| (f.path.clone(), f.len))
            .collect(),
    };
    let answer: SnapshotHave = link
        .call(SNAPSHOT_OFFER, &offer, SNAPSHOT_CALL_TIMEOUT)
        .await?;
    let resumed: u64 = answer.have.iter().sum();
    let mut sent = 0u64;
    for (file, entry) in files.files.iter().enumerate() {
        let mut have = answer.have.get(file).copied().unwrap_or(0).min(entry.len);
        let mut refusals = 0;
        while have < entry.len {
            let read = files.clone();
            let bytes = tokio::task::spawn_blocking(move || read.read_chunk(file, have))
                .await
                .map_err(|e| CallError::Snapshot(e.to_string()))?
                .map_err(|e| CallError::Snapshot(format!("{}: {e}", entry.path)))?;
            let chunk = SnapshotChunk {
                vote,
                snapshot_id: meta.snapshot_id.clone(),
                file: u32::try_from(file).unwrap_or(u32::MAX),
                offset: have,
                crc: crc32c::crc32c(&bytes),
                bytes,
            };
            let taken: ChunkTaken = link
                .call(SNAPSHOT_CHUNK, &chunk, SNAPSHOT_CALL_TIMEOUT)
                .await?;
            if taken.have > have {
                sent += taken.have - have;
                refusals = 0;
            } else {
                refusals += 1;
                if refusals >= CHUNK_REFUSALS {
                    let why = format!(
                        "member {} refused a chunk of {} at byte {have} {refusals} times",
                        link.target, entry.path
                    );
                    return Err(CallError::Snapshot(why));
                }
            }
            have = taken.have.min(entry.len);
        }
    }
    // Logged before the install: a member that installs it restarts before it answers.
    let seconds = started.elapsed().as_secs_f64();
    tracing::info!(
        member = link.target,
        snapshot = %meta.snapshot_id,
        bytes = files.bytes(),
        sent,
        resumed,
        seconds,
        "sent a snapshot's files; asking the member to install it"
    );
    metrics::counter!("delayd_cluster_snapshot_sent_bytes_total").increment(sent);
    let install = SnapshotInstall {
        vote,
        snapshot_id: meta.snapshot_id.clone(),
    };
    link.call(SNAPSHOT_INSTALL, &install, SNAPSHOT_CALL_TIMEOUT)
        .await
}

/// A member's answers to the others' Raft RPCs, given to `peer::serve`. It tells `handoff` what it
/// saw: appends accepted from a leader, and candidates refused for their shorter log.
pub struct RaftService {
    raft: openraft::Raft<TypeConfig>,
    handoff: Arc<Handoff>,
    snapshots: Snapshots,
    rejoin: Rejoin,
}

impl std::fmt::Debug for RaftService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftService").finish_non_exhaustive()
    }
}

impl RaftService {
    /// `rejoin`: whether this member holds its votes until it has caught up (rejoin.rs).
    pub fn new(
        raft: openraft::Raft<TypeConfig>,
        handoff: Arc<Handoff>,
        snapshots: Snapshots,
        rejoin: Rejoin,
    ) -> RaftService {
        RaftService {
            raft,
            handoff,
            snapshots,
            rejoin,
        }
    }

    /// A snapshot's offer, chunk or install, from the member its vote names.
    async fn snapshot(&self, from: u64, kind: u8, payload: Vec<u8>) -> Result<Vec<u8>, String> {
        let current = self.raft.metrics().borrow().vote;
        let (vote, received) =
            match receive_snapshot(self.snapshots.clone(), current, from, kind, payload).await? {
                Receiving::Answer(answer) => return Ok(answer),
                Receiving::Install(vote, received) => (vote, received),
            };
        let (received, _installing) = match received {
            Received::Whole(snapshot, installing) => (snapshot, installing),
            // Applied here already: the answer openraft would give, this member's vote.
            Received::Held => {
                let vote = self.raft.metrics().borrow().vote;
                return SnapshotResponse { vote }
                    .encode()
                    .map_err(|e| e.to_string());
            }
        };
        let id = received.meta.snapshot_id.clone();
        let installed = self.raft.install_full_snapshot(vote, received).await;
        // Still here: openraft did not install it (this member applied its entries meanwhile).
        if let Err(error) = self.snapshots.discard_incoming(&id) {
            tracing::warn!(%error, "the staged files of a snapshot not installed could not be removed");
        }
        match installed {
            Ok(response) => response.encode().map_err(|e| e.to_string()),
            Err(fatal) => Err(rpc::raft_error_text(&RaftError::Fatal(fatal))),
        }
    }
}

/// What a snapshot request comes to on the member that receives it.
enum Receiving {
    /// The answer to an offer or a chunk.
    Answer(Vec<u8>),
    /// An install request (its vote), with the snapshot received whole (or held already).
    Install(Vote<u64>, Received),
}

/// Takes a snapshot's offer, chunk or install request (the file work on a blocking thread): what to
/// answer, or what to install. A refusal's text is the error answer.
async fn receive_snapshot(
    snapshots: Snapshots,
    current: Vote<u64>,
    from: u64,
    kind: u8,
    payload: Vec<u8>,
) -> Result<Receiving, String> {
    let refused = move |error: super::snapshot::SnapshotError| {
        tracing::warn!(from, %error, "a snapshot request is refused");
        error.to_string()
    };
    // A deposed leader's transfer would throw away the current one's staged files.
    let current_leader = move |vote: &Vote<u64>| {
        match *vote >= current {
        true => Ok(()),
        false => Err(format!(
            "a snapshot from member {from} in an older vote ({vote}) than this member's ({current}): refused"
        )),
    }
    };
    let work = move || -> Result<Receiving, String> {
        match kind {
            SNAPSHOT_OFFER => {
                let offer = take::<SnapshotOffer>(from, &payload)?;
                speaks_for(from, &offer.vote)?;
                current_leader(&offer.vote)?;
                let have = snapshots.offer(offer).map_err(refused)?;
                have.encode()
                    .map(Receiving::Answer)
                    .map_err(|e| e.to_string())
            }
            SNAPSHOT_CHUNK => {
                let chunk = take::<SnapshotChunk>(from, &payload)?;
                speaks_for(from, &chunk.vote)?;
                current_leader(&chunk.vote)?;
                let taken = snapshots.chunk(&chunk).map_err(refused)?;
                taken
                    .encode()
                    .map(Receiving::Answer)
                    .map_err(|e| e.to_string())
            }
            _ => {
                let install = take::<SnapshotInstall>(from, &payload)?;
                speaks_for(from, &install.vote)?;
                let received = snapshots.received(&install.snapshot_id).map_err(refused)?;
                Ok(Receiving::Install(install.vote, received))
            }
        }
    };
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|e| Err(format!("a snapshot request's task failed: {e}")))
}

impl PeerService for RaftService {
    fn handle(
        &self,
        from: u64,
        kind: u8,
        payload: Vec<u8>,
    ) -> BoxFuture<'_, Result<Vec<u8>, String>> {
        Box::pin(async move {
            match kind {
                VOTE => {
                    let request = take::<VoteRequest<u64>>(from, &payload)?;
                    speaks_for(from, &request.vote)?;
                    let (vote, applied) = {
                        let metrics = self.raft.metrics();
                        let metrics = metrics.borrow();
                        (metrics.vote, metrics.last_applied)
                    };
                    if let Some(refusal) = self.rejoin.refusal(vote, applied) {
                        tracing::info!(from, "a vote refused: this member joined empty and has not caught up yet");
                        return refusal.encode().map_err(|e| e.to_string());
                    }
                    let (term, last) = (request.vote.leader_id.term, request.last_log_id);
                    let answered = self.raft.vote(request).await;
                    if let Ok(vote) = &answered {
                        if !vote.vote_granted && vote.last_log_id > last {
                            self.handoff.refused_shorter(term);
                        }
                    }
                    answer(answered)
                }
                APPEND => {
                    let request = take::<AppendEntriesRequest<TypeConfig>>(from, &payload)?;
                    speaks_for(from, &request.vote)?;
                    let leader_commit = request.leader_commit.map(|id| id.index);
                    let answered = self.raft.append_entries(request).await;
                    if matches!(&answered, Ok(a) if !matches!(a, AppendEntriesResponse::HigherVote(_)))
                    {
                        self.handoff.heard_leader();
                        let applied = self.raft.metrics().borrow().last_applied.map(|id| id.index);
                        if self.rejoin.heard_leader(leader_commit, applied) {
                            // Caught up: it may stand for election again.
                            self.raft.runtime_config().elect(true);
                        }
                    }
                    answer(answered)
                }
                SNAPSHOT_OFFER | SNAPSHOT_CHUNK | SNAPSHOT_INSTALL => {
                    self.snapshot(from, kind, payload).await
                }
                other => Err(format!(
                    "no Raft request of kind {other} is served here (vote {VOTE}, append {APPEND}, snapshot {SNAPSHOT_OFFER} to {SNAPSHOT_INSTALL})"
                )),
            }
        })
    }
}

/// The request in `payload`, or the error text its caller gets.
fn take<Q: Wire>(from: u64, payload: &[u8]) -> Result<Q, String> {
    Q::decode(payload).map_err(|error| {
        tracing::warn!(from, %error, "a member's Raft request does not decode");
        error.to_string()
    })
}

/// Refuses a request whose vote is another member's than its authenticated caller's.
fn speaks_for(from: u64, vote: &Vote<u64>) -> Result<(), String> {
    let named = vote.leader_id.node_id;
    if named == from {
        return Ok(());
    }
    tracing::warn!(
        from,
        named,
        "a member sent a Raft request in another member's name; refused"
    );
    Err(format!(
        "member {from} cannot send a request of member {named}'s vote"
    ))
}

/// The encoded answer, or the member's error as its JSON text.
fn answer<A: Wire>(answered: Result<A, RaftError<u64>>) -> Result<Vec<u8>, String> {
    match answered {
        Ok(answer) => answer.encode().map_err(|error| error.to_string()),
        Err(error) => Err(rpc::raft_error_text(&error)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn client(peer: &str) -> MemberClient {
        let link = MemberLink {
            id: 1,
            target: 2,
            peer: peer.into(),
            secret: Secret("a long random string".into()),
            options: PeerOptions::default(),
            client: Mutex::new(None),
            answers: Answers::default(),
            failures: Mutex::default(),
        };
        MemberClient {
            link: Arc::new(link),
            member: Member {
                api: "http://127.0.0.1:7072".into(),
                peer: peer.into(),
            },
        }
    }

    fn peer_error(error: PeerError) -> CallError {
        CallError::Peer(error)
    }

    const PEER: SocketAddr =
        SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 7172);

    #[test]
    fn link_failures_map_to_what_makes_openraft_back_off_or_retry() {
        let client = client("127.0.0.1:7172");
        let io = |kind: std::io::ErrorKind| {
            peer_error(PeerError::Io {
                peer: PEER,
                source: kind.into(),
            })
        };
        let map = |error| client.rpc_error(RPCTypes::AppendEntries, 4, error);
        assert!(matches!(
            map(io(std::io::ErrorKind::ConnectionRefused)),
            RPCError::Unreachable(_)
        ));
        assert!(matches!(
            map(io(std::io::ErrorKind::ConnectionReset)),
            RPCError::Network(_)
        ));
        let refused = peer_error(PeerError::Refused {
            peer: PEER,
            why: "another cluster.secret".into(),
        });
        assert!(matches!(map(refused), RPCError::Unreachable(_)));
        let resolve = CallError::Resolve {
            peer: "delayd-2.invalid:7172".into(),
            source: std::io::ErrorKind::NotFound.into(),
        };
        assert!(matches!(map(resolve), RPCError::Unreachable(_)));
        let after = Duration::from_millis(250);
        match map(CallError::Deadline { after }) {
            RPCError::Timeout(timeout) => {
                assert_eq!((timeout.id, timeout.target, timeout.timeout), (1, 2, after));
                assert_eq!(timeout.action, RPCTypes::AppendEntries);
            }
            other => panic!("{other:?}"),
        }
        let timed_out = peer_error(PeerError::Timeout {
            peer: PEER,
            what: "a request",
            after,
        });
        assert!(matches!(map(timed_out), RPCError::Timeout(_)));
        let garbled = CallError::Decode(VoteResponse::<u64>::decode(&[]).unwrap_err());
        assert!(matches!(map(garbled), RPCError::Network(_)));
    }

    #[test]
    fn answers_map_to_remote_errors_only_when_they_are_raft_errors() {
        let client = client("127.0.0.1:7172");
        let fatal: RaftError<u64> = RaftError::Fatal(Fatal::Stopped);
        let answered = |text: String| peer_error(PeerError::Answered { peer: PEER, text });
        match client.rpc_error(RPCTypes::Vote, 0, answered(rpc::raft_error_text(&fatal))) {
            RPCError::RemoteError(remote) => {
                assert_eq!(remote.target, 2);
                assert_eq!(remote.target_node, Some(client.member.clone()));
                assert_eq!(remote.source, fatal);
            }
            other => panic!("{other:?}"),
        }
        let refused = answered("no Raft request of kind 9 is served here".into());
        assert!(matches!(
            client.rpc_error(RPCTypes::Vote, 0, refused),
            RPCError::Network(_)
        ));
    }

    #[test]
    fn an_append_over_the_frame_limit_is_split_until_one_entry_is_left() {
        let client = client("127.0.0.1:7172");
        let too_large = || {
            peer_error(PeerError::TooLarge {
                peer: PEER,
                bytes: 100,
                max: 10,
            })
        };
        match client.rpc_error(RPCTypes::AppendEntries, 9, too_large()) {
            RPCError::PayloadTooLarge(too_large) => assert_eq!(too_large.entries_hint(), 4),
            other => panic!("{other:?}"),
        }
        // One entry cannot be split: retrying at once would spin, so openraft backs off.
        assert!(matches!(
            client.rpc_error(RPCTypes::AppendEntries, 1, too_large()),
            RPCError::Unreachable(_)
        ));
    }

    #[tokio::test]
    async fn a_snapshot_for_a_member_that_does_not_listen_is_unreachable_so_openraft_backs_off() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let mut client = client(&addr.to_string());
        let snapshot = Snapshot {
            meta: Default::default(),
            snapshot: Box::new(SnapshotFiles::new(std::env::temp_dir(), Vec::new())),
        };
        let sent = client
            .full_snapshot(
                Vote::default(),
                snapshot,
                std::future::pending(),
                RPCOption::new(Duration::from_secs(1)),
            )
            .await;
        assert!(
            matches!(sent, Err(StreamingError::Unreachable(_))),
            "{sent:?}"
        );
    }

    #[tokio::test]
    async fn a_member_that_does_not_listen_is_unreachable() {
        // A port that was just free: nothing listens on it.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let mut network =
            PeerNetwork::new(1, "a long random string", PeerOptions::default()).unwrap();
        let member = Member {
            api: String::new(),
            peer: addr.to_string(),
        };
        let mut client = network.new_client(2, &member).await;
        let request = VoteRequest::new(Vote::new(1, 1), None);
        let voted = client
            .vote(request, RPCOption::new(Duration::from_secs(5)))
            .await;
        assert!(matches!(voted, Err(RPCError::Unreachable(_))), "{voted:?}");
        // Another client of the same member shares its link; a new address makes a new one.
        let again = network.new_client(2, &member).await;
        assert!(Arc::ptr_eq(&client.link, &again.link));
        let moved = Member {
            peer: "127.0.0.1:1".into(),
            ..member
        };
        assert!(!Arc::ptr_eq(
            &client.link,
            &network.new_client(2, &moved).await.link
        ));
    }

    /// Stands in for a member's [`RaftService`] on a real peer link: grants votes, answers appends
    /// with a stopped Raft's error, and anything else with bytes that are no answer.
    struct Scripted;

    impl PeerService for Scripted {
        fn handle(
            &self,
            from: u64,
            kind: u8,
            payload: Vec<u8>,
        ) -> BoxFuture<'_, Result<Vec<u8>, String>> {
            Box::pin(async move {
                match kind {
                    VOTE => {
                        let request = take::<VoteRequest<u64>>(from, &payload)?;
                        speaks_for(from, &request.vote)?;
                        answer(Ok(VoteResponse::new(request.vote, None, true)))
                    }
                    APPEND => {
                        take::<AppendEntriesRequest<TypeConfig>>(from, &payload)?;
                        answer::<AppendEntriesResponse<u64>>(Err(RaftError::Fatal(Fatal::Stopped)))
                    }
                    _ => Ok(b"garbage".to_vec()),
                }
            })
        }
    }

    #[tokio::test]
    async fn rpcs_travel_the_peer_link_and_come_back_as_openraft_expects() {
        const SECRET: &str = "a long random string";
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let member = Member {
            api: "http://127.0.0.1:7072".into(),
            peer: listener.local_addr().unwrap().to_string(),
        };
        let served = crate::peer::serve(
            listener,
            2,
            SECRET,
            PeerOptions::default(),
            Arc::new(Scripted),
        )
        .unwrap();
        let _served = tokio::spawn(served);
        let mut network = PeerNetwork::new(1, SECRET, PeerOptions::default()).unwrap();
        let mut client = network.new_client(2, &member).await;
        let option = || RPCOption::new(Duration::from_secs(5));

        let vote = Vote::new(7, 1);
        let voted = client
            .vote(VoteRequest::new(vote, None), option())
            .await
            .unwrap();
        assert!(voted.vote_granted && voted.vote == vote, "{voted:?}");

        let append = AppendEntriesRequest::<TypeConfig> {
            vote: Vote::new_committed(7, 1),
            prev_log_id: None,
            leader_commit: None,
            entries: Vec::new(),
        };
        match client.append_entries(append.clone(), option()).await {
            Err(RPCError::RemoteError(remote)) => {
                assert_eq!(remote.source, RaftError::Fatal(Fatal::Stopped));
                assert_eq!(remote.target_node, Some(member.clone()));
            }
            other => panic!("{other:?}"),
        }

        // A vote in another member's name is refused by the member, which the caller takes for a
        // network error.
        let forged = client
            .vote(VoteRequest::new(Vote::new(7, 3), None), option())
            .await;
        assert!(matches!(forged, Err(RPCError::Network(_))), "{forged:?}");

        // An answer that does not decode is a network error too.
        let garbled = client
            .link
            .call::<_, VoteResponse<u64>>(9, &VoteRequest::new(vote, None), Duration::from_secs(5))
            .await;
        assert!(
            matches!(
                garbled.as_ref().map_err(CallError::verdict),
                Err(Verdict::Network)
            ),
            "{garbled:?}"
        );
    }

    #[test]
    fn a_short_secret_is_refused_at_the_start() {
        assert!(matches!(
            PeerNetwork::new(1, "short", PeerOptions::default()),
            Err(PeerError::WeakSecret)
        ));
    }

    #[test]
    fn a_request_in_another_members_name_is_refused() {
        let vote = Vote::new(3, 2);
        assert!(speaks_for(2, &vote).is_ok());
        let refused = speaks_for(3, &vote).unwrap_err();
        assert!(refused.contains("member 3 cannot send"), "{refused}");
    }
}

/// A snapshot's transfer under faults, over a real peer link through a TCP proxy: cut halfway it
/// resumes where the member is; a chunk damaged on the way is refused and sent again.
#[cfg(test)]
mod snapshot_faults {
    use super::*;
    use crate::cluster::snapshot::{SnapshotFile, CHUNK_BYTES};
    use openraft::{LeaderId, LogId, SnapshotMeta};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const SECRET: &str = "a long random string";

    /// Receives snapshots as a member does (`receive_snapshot`); an install answers the vote and
    /// keeps what it would have installed.
    struct Receiver {
        snapshots: Snapshots,
        installed: Mutex<Vec<Snapshot<TypeConfig>>>,
    }

    impl PeerService for Receiver {
        fn handle(
            &self,
            from: u64,
            kind: u8,
            payload: Vec<u8>,
        ) -> BoxFuture<'_, Result<Vec<u8>, String>> {
            Box::pin(async move {
                match receive_snapshot(self.snapshots.clone(), Vote::default(), from, kind, payload)
                    .await?
                {
                    Receiving::Answer(answer) => Ok(answer),
                    Receiving::Install(vote, Received::Whole(snapshot, _installing)) => {
                        self.installed.lock().unwrap().push(snapshot);
                        SnapshotResponse { vote }
                            .encode()
                            .map_err(|e| e.to_string())
                    }
                    Receiving::Install(_, Received::Held) => Err("held already".into()),
                }
            })
        }
    }

    /// Forwards connections to `target`; counts the bytes sent towards it; cuts the first
    /// connection that has carried `cut_after` bytes, and flips the byte at `flip_at` of the first
    /// connection's stream. Each fault happens once.
    struct FaultyProxy {
        port: u16,
        forwarded: Arc<AtomicU64>,
    }

    impl FaultyProxy {
        async fn start(target: SocketAddr, cut_after: u64, flip_at: u64) -> FaultyProxy {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            let forwarded = Arc::new(AtomicU64::new(0));
            let (cut, flipped) = (
                Arc::new(AtomicBool::new(false)),
                Arc::new(AtomicBool::new(false)),
            );
            let counted = forwarded.clone();
            tokio::spawn(async move {
                loop {
                    let Ok((inbound, _)) = listener.accept().await else {
                        return;
                    };
                    let Ok(outbound) = tokio::net::TcpStream::connect(target).await else {
                        continue;
                    };
                    let (mut in_read, mut in_write) = inbound.into_split();
                    let (mut out_read, mut out_write) = outbound.into_split();
                    let (counted, cut, flipped) = (counted.clone(), cut.clone(), flipped.clone());
                    let towards = tokio::spawn(async move {
                        let mut at = 0u64;
                        let mut buffer = vec![0u8; 64 << 10];
                        loop {
                            let Ok(n) = in_read.read(&mut buffer).await else {
                                return;
                            };
                            if n == 0 {
                                return;
                            }
                            let bytes = &mut buffer[..n];
                            if (at..at + n as u64).contains(&flip_at)
                                && !flipped.swap(true, Ordering::SeqCst)
                            {
                                bytes[(flip_at - at) as usize] ^= 0xff;
                            }
                            at += n as u64;
                            counted.fetch_add(n as u64, Ordering::SeqCst);
                            if out_write.write_all(bytes).await.is_err() {
                                return;
                            }
                            if at >= cut_after && !cut.swap(true, Ordering::SeqCst) {
                                return; // drops both halves towards the member: the link is cut
                            }
                        }
                    });
                    tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut out_read, &mut in_write).await;
                    });
                    let _ = towards.await;
                }
            });
            FaultyProxy { port, forwarded }
        }
    }

    #[tokio::test]
    async fn a_cut_transfer_resumes_and_a_damaged_chunk_is_sent_again() {
        // The leader's snapshot: a file of 3.5 chunks, a small one and an empty one.
        let leader = tempfile::tempdir().unwrap();
        let big: Vec<u8> = (0..CHUNK_BYTES * 7 / 2)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        std::fs::create_dir_all(leader.path().join("schedule")).unwrap();
        std::fs::write(leader.path().join("schedule/a.log"), &big).unwrap();
        std::fs::write(leader.path().join("checkpoint"), b"small").unwrap();
        std::fs::write(leader.path().join("meta"), b"").unwrap();
        let files = SnapshotFiles::new(
            leader.path().to_path_buf(),
            vec![
                SnapshotFile {
                    path: "schedule/a.log".into(),
                    len: big.len() as u64,
                },
                SnapshotFile {
                    path: "checkpoint".into(),
                    len: 5,
                },
                SnapshotFile {
                    path: "meta".into(),
                    len: 0,
                },
            ],
        );
        let meta = SnapshotMeta {
            last_log_id: Some(LogId::new(LeaderId::new(3, 1), 42)),
            last_membership: Default::default(),
            snapshot_id: "42-3-1-1-1".into(),
        };

        // The member: an empty replicated log, its snapshots received through the peer link.
        let member = tempfile::tempdir().unwrap();
        let options = schedulelog::Options {
            replicated: true,
            ..Default::default()
        };
        let log =
            Arc::new(schedulelog::ScheduleLog::open(member.path().join("data"), options).unwrap());
        let raft_dir = member.path().join("raft");
        let snapshots = Snapshots::new(2, log, &raft_dir, None, Arc::new(|| {}));
        let receiver = Arc::new(Receiver {
            snapshots,
            installed: Mutex::default(),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = listener.local_addr().unwrap();
        let served = crate::peer::serve(
            listener,
            2,
            SECRET,
            PeerOptions::default(),
            receiver.clone(),
        )
        .unwrap();
        let _served = tokio::spawn(served);
        // Cut after two chunks and a half; damage a byte in the middle of the first chunk.
        let proxy = FaultyProxy::start(
            target,
            (CHUNK_BYTES * 5 / 2) as u64,
            (CHUNK_BYTES / 2) as u64,
        )
        .await;
        let mut client = tests::client(&format!("127.0.0.1:{}", proxy.port));
        let vote = Vote::new_committed(3, 1);
        let snapshot = || Snapshot {
            meta: meta.clone(),
            snapshot: Box::new(files.clone()),
        };

        let first = send_snapshot(&client.link, vote, snapshot()).await;
        assert!(first.is_err(), "the link was cut: {first:?}");
        let staged = raft_dir.join("incoming/42-3-1-1-1/schedule/a.log");
        let held = std::fs::metadata(&staged).unwrap().len();
        // 2.5 chunks' worth went through before the cut: the first chunk damaged (refused), the
        // first again (taken), half the second.
        assert_eq!(
            held, CHUNK_BYTES as u64,
            "the first chunk, taken the second time"
        );
        assert!(receiver.installed.lock().unwrap().is_empty());

        let before = proxy.forwarded.load(Ordering::SeqCst);
        let response = client
            .full_snapshot(
                vote,
                snapshot(),
                std::future::pending(),
                RPCOption::new(Duration::from_secs(5)),
            )
            .await
            .unwrap();
        assert_eq!(response.vote, vote);
        let resent = proxy.forwarded.load(Ordering::SeqCst) - before;
        assert!(
            resent < big.len() as u64 - held + (CHUNK_BYTES as u64 / 4),
            "resumed from byte {held}, not from the start: {resent} bytes sent again"
        );
        let installed = receiver.installed.lock().unwrap().pop().expect("installed");
        assert_eq!(installed.meta, meta);
        for file in &files.files {
            let got = std::fs::read(installed.snapshot.dir.join(&file.path)).unwrap();
            let sent = std::fs::read(leader.path().join(&file.path)).unwrap();
            assert!(got == sent, "{} arrived whole and unchanged", file.path);
        }
    }
}
