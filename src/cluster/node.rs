//! A running cluster member (DESIGN.md §10): its Raft over the replicated schedule log, its peer
//! listener, its proposer, the delivery lease it keeps while it leads, and what it reports
//! (`GET /v1/cluster`, `/readyz`, the `delayd_cluster_*` metrics).
//!
//! Invariants:
//! - The cluster forms by itself: every member started with the same members and nothing in its log
//!   proposes that membership as its first entry (all of them the same entry, so it does not matter
//!   who wins the first election); one that was a member already (a log or a vote), or one started
//!   to join a running cluster (`join`), proposes nothing.
//! - The delivery lease (`scheduler::Lease`) is extended only by a round of heartbeats that a majority
//!   acknowledged, to the moment the round was sent plus half the election timeout. openraft's
//!   followers refuse to vote for anyone else for the longest election timeout (the election timeout
//!   itself, `super::raft_config`) after such a heartbeat, so the lease ends before another member can
//!   be elected, by half an election timeout at least, which is this member's margin to stop handing
//!   batches to sinks. A member that stands by itself (handoff.rs) waits as long since its own last
//!   acknowledgement of a leader.
//! - A member that does not lead holds no lease.

use super::handoff::Handoff;
use super::network::{Answers, PeerNetwork, RaftService};
use super::rejoin::Rejoin;
use super::snapshot::Snapshots;
use super::store::{Applier, LogStore, StateMachine};
use super::{Member, TypeConfig};
use crate::peer::{self, PeerOptions};
use crate::scheduler::Lease;
use anyhow::Context;
use openraft::{Raft, ServerState};
use schedulelog::{Clock, ScheduleLog};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a member is started with (the `[cluster]` section).
#[derive(Debug, Clone)]
pub struct Settings {
    pub id: u64,
    /// Where the peer listener binds: `host:port`.
    pub listen: String,
    pub secret: String,
    pub election_timeout: Duration,
    /// Entries applied between two snapshots (`cluster.snapshot_entries`).
    pub snapshot_entries: u64,
    /// Never found a cluster: wait to be added to a running one (`cluster.join`).
    pub join: bool,
    /// Every member, this one too, by id.
    pub members: BTreeMap<u64, Member>,
}

/// A running member. Stop it with [`Node::shutdown`].
pub struct Node {
    id: u64,
    raft: Raft<TypeConfig>,
    store: LogStore,
    answers: Answers,
    election_timeout: Duration,
    lease: Arc<Lease>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    proposer: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Node {
    /// Starts member `settings.id` on `log` (opened replicated), with its vote in `raft_dir`: binds
    /// the peer listener, starts Raft, founds the cluster if nobody has yet, and starts proposing.
    /// `applier` applies committed entries' application payloads (the built-in broker's ops) on this
    /// member, before each entry is filed; `snapshots` takes, receives and installs its snapshots.
    pub async fn start(
        settings: Settings,
        log: &Arc<ScheduleLog>,
        raft_dir: &Path,
        clock: Arc<dyn Clock>,
        applier: Option<Applier>,
        snapshots: Snapshots,
    ) -> anyhow::Result<Node> {
        let Settings {
            id,
            listen,
            secret,
            election_timeout,
            snapshot_entries,
            join,
            members,
        } = settings;
        let listener = tokio::net::TcpListener::bind(&listen)
            .await
            .with_context(|| format!("binding cluster.listen {listen}"))?;
        let store = LogStore::open(log.clone(), raft_dir, snapshots.installing())
            .with_context(|| format!("opening the Raft state in {}", raft_dir.display()))?;
        let machine = StateMachine::new(log.clone(), applier, snapshots.clone());
        let network = PeerNetwork::new(id, &secret, PeerOptions::default())?;
        let answers = network.answers();
        let raft = Raft::new(
            id,
            super::raft_config(election_timeout, snapshot_entries),
            network,
            store.clone(),
            machine,
        )
        .await
        .context("starting Raft")?;
        let handoff = Arc::new(Handoff::default());
        // Empty at start: no log, no vote (as openraft sees it before anything is founded).
        let empty = !raft.is_initialized().await.unwrap_or(true);
        let rejoin = Rejoin::open(raft_dir, join && empty)
            .with_context(|| format!("opening the rejoin hold in {}", raft_dir.display()))?;
        if rejoin.holds() {
            tracing::info!(member = id, "joined empty: this member neither votes nor stands for election until it has caught up");
            raft.runtime_config().elect(false);
        }
        let service = Arc::new(RaftService::new(
            raft.clone(),
            handoff.clone(),
            snapshots,
            rejoin,
        ));
        let serving = peer::serve(listener, id, &secret, PeerOptions::default(), service)?;
        let mut tasks = vec![
            tokio::spawn(serving),
            tokio::spawn(super::handoff::run(
                raft.clone(),
                handoff,
                id,
                election_timeout,
            )),
        ];
        // A member that holds a log or a vote was part of the cluster already: nothing to found. One
        // being added to a running cluster founds nothing either: the leader's entries make it a
        // member (a membership of its own, however like the file's, would not be the cluster's).
        let founded = join || raft.is_initialized().await.unwrap_or(true);
        let found = async {
            match founded {
                true => Ok(()),
                false => raft.initialize(members.clone()).await.map(|()| {
                    tracing::info!(member = id, "founded the cluster");
                }),
            }
        };
        match found.await {
            Ok(()) => {}
            Err(e)
                if e.api_error().is_some_and(|e| {
                    matches!(e, openraft::error::InitializeError::NotAllowed(_))
                }) => {}
            Err(e) => {
                let _ = raft.shutdown().await;
                tasks.iter().for_each(|t| t.abort());
                return Err(anyhow::anyhow!("founding the cluster: {e}"));
            }
        }
        let proposer = match super::propose::start(
            raft.clone(),
            log,
            clock,
            tokio::runtime::Handle::current(),
            answer_within(election_timeout),
        ) {
            Ok(proposer) => proposer,
            Err(error) => {
                let _ = raft.shutdown().await;
                tasks.iter().for_each(|t| t.abort());
                return Err(anyhow::Error::new(error).context("starting the proposer"));
            }
        };
        let lease = Arc::new(Lease::new());
        tasks.push(tokio::spawn(keep_lease(
            raft.clone(),
            lease.clone(),
            election_timeout,
        )));
        tasks.push(tokio::spawn(report(
            raft.clone(),
            store.clone(),
            lease.clone(),
        )));
        Ok(Node {
            id,
            raft,
            store,
            answers,
            election_timeout,
            lease,
            tasks,
            proposer: Mutex::new(proposer),
        })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn raft(&self) -> &Raft<TypeConfig> {
        &self.raft
    }

    pub fn election_timeout(&self) -> Duration {
        self.election_timeout
    }

    /// The delivery lease this member holds while it leads (for its scheduler).
    pub fn lease(&self) -> Arc<Lease> {
        self.lease.clone()
    }

    /// The leader this member knows, and its client listener (`api`).
    pub fn leader(&self) -> Option<(u64, Member)> {
        let metrics = self.raft.metrics().borrow().clone();
        let leader = metrics.current_leader?;
        let member = metrics.membership_config.membership().get_node(&leader)?;
        Some((leader, member.clone()))
    }

    /// The Raft term this member is in.
    pub fn raft_term(&self) -> u64 {
        self.raft.metrics().borrow().current_term
    }

    /// Whether this member leads (as far as it knows: the lease says whether it may act on it).
    pub fn leads(&self) -> bool {
        let metrics = self.raft.metrics();
        let metrics = metrics.borrow();
        metrics.state == ServerState::Leader && metrics.current_leader == Some(self.id)
    }

    /// `/readyz` of a member: it knows a leader, and has applied every entry it knows is committed.
    pub fn ready(&self) -> Result<(), String> {
        let (leader, applied) = {
            let metrics = self.raft.metrics();
            let metrics = metrics.borrow();
            if let Err(fatal) = &metrics.running_state {
                return Err(format!("Raft stopped: {fatal}"));
            }
            let applied = metrics.last_applied.map(|id| id.index);
            (metrics.current_leader, applied)
        };
        match leader {
            None => return Err("no leader is known".into()),
            Some(leader) if leader == self.id && !self.lease.holds() => {
                return Err(
                    "this member leads in name only: no majority has confirmed its lead lately"
                        .into(),
                )
            }
            Some(_) => {}
        }
        let committed = self.store.committed_index();
        if committed > applied {
            return Err(format!(
                "applied up to entry {}, committed up to {}",
                applied.unwrap_or(0),
                committed.unwrap_or(0)
            ));
        }
        Ok(())
    }

    /// `GET /v1/cluster`.
    pub fn status(&self) -> ClusterStatus {
        let metrics = self.raft.metrics().borrow().clone();
        let membership = metrics.membership_config.membership();
        let leads = metrics.state == ServerState::Leader;
        let matched = metrics.replication.as_ref();
        let members = membership
            .nodes()
            .map(|(&id, member)| {
                let voter = membership.voter_ids().any(|v| v == id);
                let state = if id == self.id {
                    match metrics.state {
                        ServerState::Leader => "leader",
                        ServerState::Follower => "follower",
                        ServerState::Candidate => "candidate",
                        ServerState::Learner => "learner",
                        ServerState::Shutdown => "unreachable",
                    }
                } else if metrics.current_leader == Some(id) {
                    "leader"
                } else if leads && !self.answered_lately(id) {
                    "unreachable"
                } else if voter {
                    "follower"
                } else {
                    "learner"
                };
                let matched_index = match (leads, matched) {
                    (true, Some(_)) if id == self.id => metrics.last_log_index,
                    (true, Some(matched)) => matched.get(&id).copied().flatten().map(|l| l.index),
                    _ => None,
                };
                MemberStatus {
                    id,
                    api: member.api.clone(),
                    peer: member.peer.clone(),
                    voter,
                    state,
                    matched_index,
                }
            })
            .collect();
        ClusterStatus {
            node_id: self.id,
            leader_id: metrics.current_leader,
            term: metrics.current_term,
            commit_index: self.store.committed_index(),
            applied_index: metrics.last_applied.map(|id| id.index),
            members,
        }
    }

    /// Whether member `id` answered one of this member's calls at `since` or later.
    pub fn answered_since(&self, id: u64, since: Instant) -> bool {
        self.answers.last(id).is_some_and(|at| at >= since)
    }

    /// Whether member `id` answered one of this member's calls within the last election timeout.
    pub fn answered_lately(&self, id: u64) -> bool {
        self.answers
            .last(id)
            .is_some_and(|at| at.elapsed() < self.election_timeout)
    }

    /// Stops Raft, the peer listener and the lease; the proposer ends once the log closes (its owner
    /// closes it after this). Waits for nothing that could hang on another member.
    pub async fn shutdown(&self) {
        self.lease.revoke();
        for task in &self.tasks {
            task.abort();
        }
        if let Err(error) = self.raft.shutdown().await {
            tracing::warn!(%error, "Raft did not stop cleanly");
        }
    }

    /// The proposer's thread, to join once the log is closed.
    pub fn take_proposer(&self) -> Option<std::thread::JoinHandle<()>> {
        self.proposer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

/// `GET /v1/cluster` (DESIGN.md §10).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ClusterStatus {
    pub node_id: u64,
    pub leader_id: Option<u64>,
    pub term: u64,
    pub commit_index: Option<u64>,
    pub applied_index: Option<u64>,
    pub members: Vec<MemberStatus>,
}

/// A member as this one sees it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct MemberStatus {
    pub id: u64,
    pub api: String,
    pub peer: String,
    pub voter: bool,
    /// `leader`, `follower`, `candidate`, `learner` or `unreachable` (a member the leader has not
    /// heard from within an election timeout).
    pub state: &'static str,
    /// The last entry the leader knows the member holds; null on other members.
    pub matched_index: Option<u64>,
}

/// How long a write waits for its entry to be committed before its writer is told its fate is
/// unknown: a few election timeouts, so that a failover under way is not mistaken for a lost quorum.
fn answer_within(election_timeout: Duration) -> Duration {
    (election_timeout * 3).max(Duration::from_secs(2))
}

/// Keeps `lease` while this member leads: a round of heartbeats every heartbeat interval, each
/// acknowledged by a majority extending it (module doc), and only for the Raft term it was sent in;
/// revoked as soon as this member no longer leads, or leads in another term.
async fn keep_lease(raft: Raft<TypeConfig>, lease: Arc<Lease>, election_timeout: Duration) {
    let heartbeat = election_timeout / 4;
    let mut metrics = raft.metrics();
    loop {
        let (leads, term) = {
            let m = metrics.borrow_and_update();
            (m.state == ServerState::Leader, m.current_term)
        };
        if !leads {
            lease.revoke();
            if metrics.changed().await.is_err() {
                return;
            }
            continue;
        }
        let sent = Instant::now();
        let confirmed = tokio::time::timeout(election_timeout, raft.get_read_log_id()).await;
        let same_lead = |m: &openraft::RaftMetrics<u64, Member>| {
            m.state == ServerState::Leader && m.current_term == term
        };
        if !same_lead(&metrics.borrow()) {
            lease.revoke();
            continue;
        }
        if let Ok(Ok(_)) = confirmed {
            lease.extend_to(sent + election_timeout / 2);
        }
        // The next round at the next heartbeat; the lease goes at once if the lead does meanwhile.
        let next = tokio::time::Instant::from_std(sent + heartbeat);
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(next) => break,
                changed = metrics.changed() => {
                    if changed.is_err() {
                        lease.revoke();
                        return;
                    }
                    if !same_lead(&metrics.borrow_and_update()) {
                        lease.revoke();
                        break;
                    }
                }
            }
        }
    }
}

/// Sets the `delayd_cluster_*` metrics from Raft's, as they change (and once a second, for the
/// committed index, which Raft's metrics do not carry).
async fn report(raft: Raft<TypeConfig>, store: LogStore, lease: Arc<Lease>) {
    // At 0 from the start, as every unlabelled counter. It counts the terms begun after the first
    // report, and the founding election usually comes before that: without this it would not exist
    // until a second election.
    metrics::counter!("delayd_cluster_elections_total").increment(0);
    for made in [
        "delayd_cluster_snapshots_taken_total",
        "delayd_cluster_snapshots_installed_total",
        "delayd_cluster_snapshot_sent_bytes_total",
    ] {
        metrics::counter!(made).increment(0);
    }
    let mut metrics = raft.metrics();
    let mut term = None;
    let mut lagging: Vec<u64> = Vec::new();
    loop {
        {
            let m = metrics.borrow_and_update();
            // A leader no majority confirms (cut off, openraft 0.9 keeps it leading) does not count.
            let leads = m.state == ServerState::Leader && lease.holds();
            metrics::gauge!("delayd_cluster_leader").set(if leads { 1.0 } else { 0.0 });
            metrics::gauge!("delayd_cluster_term").set(m.current_term as f64);
            if let Some(before) = term.filter(|t| *t < m.current_term) {
                metrics::counter!("delayd_cluster_elections_total")
                    .increment(m.current_term - before);
            }
            term = Some(m.current_term);
            let committed = store.committed_index().unwrap_or(0);
            metrics::gauge!("delayd_cluster_commit_index").set(committed as f64);
            let applied = m.last_applied.map_or(0, |id| id.index);
            metrics::gauge!("delayd_cluster_applied_index").set(applied as f64);
            let last = m.last_log_index.unwrap_or(0);
            let mut peers = Vec::new();
            for (&peer, matched) in m.replication.iter().flatten() {
                if peer == m.id {
                    continue;
                }
                let lag = last.saturating_sub(matched.map_or(0, |l| l.index));
                metrics::gauge!("delayd_cluster_peer_lag_entries", "peer" => peer.to_string())
                    .set(lag as f64);
                peers.push(peer);
            }
            // Only the leader reports lags: a member that stopped leading zeroes its own.
            for gone in lagging.iter().filter(|p| !peers.contains(p)) {
                metrics::gauge!("delayd_cluster_peer_lag_entries", "peer" => gone.to_string())
                    .set(0.0);
            }
            lagging = peers;
        }
        // At most five reports a second, however often Raft's metrics change (each apply does).
        tokio::time::sleep(Duration::from_millis(200)).await;
        tokio::select! {
            changed = metrics.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}
