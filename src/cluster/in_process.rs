//! The log through Raft, in one process: members with real data dirs (the WAL as the Raft log), real
//! peer links on loopback (peer.rs) and openraft. A member stopped here is stopped as a process would
//! be for Raft's purposes: its Raft, its peer listener and its log are gone; "restarting" it reopens
//! its data dir.

use super::handoff::Handoff;
use super::network::{PeerNetwork, RaftService};
use super::rejoin::Rejoin;
use super::snapshot::Snapshots;
use super::store::{LogStore, StateMachine};
use super::{Member, TypeConfig};
use crate::broker::{Broker, BrokerError, BrokerOptions, Incoming};
use crate::peer::{self, PeerOptions};
use crate::source::{StateFileError, StateFiles};
use openraft::Raft;
use schedulelog::{
    AppendError, EncodedMessage, ManualClock, MessageId, MessageState, NewMessage, Options,
    Outcome, OutcomeKind, ScheduleLog,
};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const SECRET: &str = "a long random test secret";
/// The members' election timeout (300 ms made elections on a busy machine flaky).
const ELECTION_TIMEOUT: Duration = Duration::from_millis(600);
/// 2026-12-01T09:30:00Z
const T0: i64 = 1_796_117_400_000;

fn message(body: &str) -> EncodedMessage {
    NewMessage {
        deliver_at_ms: T0 + 3_600_000,
        topic: "orders.timeout".into(),
        sink: "broker".into(),
        body: body.as_bytes().to_vec(),
        ..NewMessage::default()
    }
    .encode()
    .unwrap()
}

/// One member, running.
struct Running {
    raft: Raft<TypeConfig>,
    log: Arc<ScheduleLog>,
    /// Its built-in broker, replicated through the log (as `[cluster]` in lib.rs makes it); the
    /// sources' state files are kept beside it (`sources/`), as lib.rs keeps them.
    broker: Arc<Broker>,
    proposer: std::thread::JoinHandle<()>,
    serving: tokio::task::JoinHandle<()>,
    handing_off: tokio::task::JoinHandle<()>,
}

impl Running {
    async fn stop(self) {
        self.handing_off.abort();
        self.serving.abort();
        let _ = self.serving.await;
        self.raft.shutdown().await.unwrap();
        // The last handles of the log go with the Raft's tasks; wait for them to let it go.
        // (The proposer upgrades its weak handle for a moment now and then: try until it is ours.)
        let mut log = self.log;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let log = loop {
            match Arc::try_unwrap(log) {
                Ok(log) => break log,
                Err(shared) => log = shared,
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the log is not let go"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        log.close().unwrap();
        // Closing the log ends its proposer.
        let proposer = self.proposer;
        tokio::task::spawn_blocking(move || proposer.join().unwrap())
            .await
            .unwrap();
    }
}

/// A TCP proxy in front of one member's peer listener, which refuses links from chosen callers (read
/// from the peer handshake's first bytes: magic, version, the caller's id) and cuts theirs at once.
struct Proxy {
    addr: SocketAddr,
    blocked: tokio::sync::watch::Sender<BTreeSet<u64>>,
    /// The callers of the links open now (one entry a link).
    live: Arc<std::sync::Mutex<Vec<u64>>>,
    task: tokio::task::JoinHandle<()>,
}

/// A link counted in [`Proxy::live`] while it is open.
struct Live(Arc<std::sync::Mutex<Vec<u64>>>, u64);

impl Drop for Live {
    fn drop(&mut self) {
        let mut live = self.0.lock().unwrap();
        if let Some(at) = live.iter().position(|c| *c == self.1) {
            live.swap_remove(at);
        }
    }
}

impl Proxy {
    async fn start(listener: tokio::net::TcpListener, target: SocketAddr) -> Proxy {
        use tokio::io::AsyncReadExt;
        let addr = listener.local_addr().unwrap();
        let (blocked, watch) = tokio::sync::watch::channel(BTreeSet::new());
        let live = Arc::new(std::sync::Mutex::new(Vec::new()));
        let links = live.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    continue;
                };
                let mut watch = watch.clone();
                let links = links.clone();
                tokio::spawn(async move {
                    let mut hello = [0u8; 18];
                    if inbound.read_exact(&mut hello).await.is_err() {
                        return;
                    }
                    let caller = u64::from_le_bytes(hello[10..18].try_into().unwrap());
                    links.lock().unwrap().push(caller);
                    let _live = Live(links, caller);
                    // Declared after the count: closed before it is let go.
                    let mut inbound = inbound;
                    let cut = |blocked: &BTreeSet<u64>| blocked.contains(&caller);
                    if cut(&watch.borrow_and_update()) {
                        return;
                    }
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    if tokio::io::AsyncWriteExt::write_all(&mut outbound, &hello)
                        .await
                        .is_err()
                    {
                        return;
                    }
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = watch.wait_for(cut) => {}
                    }
                });
            }
        });
        Proxy {
            addr,
            blocked,
            live,
            task,
        }
    }

    /// Refuses `callers` from now on, and waits until their links are closed.
    async fn block(&self, callers: impl IntoIterator<Item = u64>) {
        let callers: BTreeSet<u64> = callers.into_iter().collect();
        self.blocked.send_modify(|b| b.extend(&callers));
        let live = self.live.clone();
        wait_until("the cut links are closed", || {
            !live.lock().unwrap().iter().any(|c| callers.contains(c))
        })
        .await;
    }

    fn heal(&self) {
        self.blocked.send_modify(BTreeSet::clear);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Members in one process. Should a test fail midway, what runs goes with the test's runtime: the Raft
/// and peer tasks are dropped, which lets each log go, which ends its threads.
struct Cluster {
    dirs: Vec<tempfile::TempDir>,
    peers: Vec<SocketAddr>,
    /// Each member's peer listener until it first starts (bound once, so that no other test takes
    /// its port meanwhile).
    listeners: BTreeMap<u64, std::net::TcpListener>,
    /// In front of each member's listener: the address the others call it at.
    proxies: BTreeMap<u64, Proxy>,
    members: BTreeMap<u64, Member>,
    running: BTreeMap<u64, Running>,
    /// Members started as `cluster.join` starts them (rejoin.rs).
    joining: BTreeSet<u64>,
    clock: Arc<ManualClock>,
}

async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

impl Cluster {
    async fn new(size: u64) -> Cluster {
        let mut peers = Vec::new();
        let mut members = BTreeMap::new();
        let mut listeners = BTreeMap::new();
        let mut proxies = BTreeMap::new();
        for id in 1..=size {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.set_nonblocking(true).unwrap();
            let addr = listener.local_addr().unwrap();
            listeners.insert(id, listener);
            peers.push(addr);
            let front = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let proxy = Proxy::start(front, addr).await;
            let member = Member {
                api: format!("http://127.0.0.1:{}", 9000 + id),
                peer: proxy.addr.to_string(),
            };
            proxies.insert(id, proxy);
            members.insert(id, member);
        }
        let mut cluster = Cluster {
            dirs: (0..size).map(|_| tempfile::tempdir().unwrap()).collect(),
            peers,
            listeners,
            proxies,
            members,
            running: BTreeMap::new(),
            joining: BTreeSet::new(),
            clock: Arc::new(ManualClock::new(T0)),
        };
        for id in 1..=size {
            cluster.start(id).await;
        }
        let members = cluster.members.clone();
        for running in cluster.running.values() {
            match running.raft.initialize(members.clone()).await {
                Ok(()) => {}
                Err(e)
                    if e.api_error().is_some_and(|e| {
                        matches!(e, openraft::error::InitializeError::NotAllowed(_))
                    }) => {}
                Err(e) => panic!("initialize: {e}"),
            }
        }
        cluster
    }

    fn dir(&self, id: u64) -> &Path {
        self.dirs[(id - 1) as usize].path()
    }

    async fn start(&mut self, id: u64) {
        let options = Options {
            replicated: true,
            clock: self.clock.clone(),
            wal_segment_bytes: 1 << 20,
            ..Options::default()
        };
        let data = self.dir(id).join("data");
        let log = Arc::new(ScheduleLog::open(&data, options).unwrap());
        let broker = Arc::new(Broker::open(self.dir(id), BrokerOptions::default()).unwrap());
        broker.replicate_through(&log);
        let applier = crate::applier(broker.clone(), self.dir(id).to_path_buf());
        // In-process members cannot restart themselves: none of these tests sends a snapshot.
        let snapshots = Snapshots::new(
            id,
            log.clone(),
            &self.dir(id).join("raft"),
            Some(crate::app_files(broker.clone(), self.dir(id).to_path_buf())),
            Arc::new(|| panic!("an in-process member cannot restart to install a snapshot")),
        );
        let store = LogStore::open(
            log.clone(),
            &self.dir(id).join("raft"),
            snapshots.installing(),
        )
        .unwrap();
        let machine = StateMachine::new(log.clone(), Some(applier), snapshots.clone());
        let network = PeerNetwork::new(id, SECRET, PeerOptions::default()).unwrap();
        let config = super::raft_config(ELECTION_TIMEOUT, 5_000);
        let raft = Raft::new(id, config, network, store, machine)
            .await
            .unwrap();
        let listener = match self.listeners.remove(&id) {
            Some(first) => tokio::net::TcpListener::from_std(first).unwrap(),
            // A restart binds its port again.
            None => tokio::net::TcpListener::bind(self.peers[(id - 1) as usize])
                .await
                .unwrap(),
        };
        let handoff = Arc::new(Handoff::default());
        let handing_off = tokio::spawn(super::handoff::run(
            raft.clone(),
            handoff.clone(),
            id,
            ELECTION_TIMEOUT,
        ));
        let empty = !raft.is_initialized().await.unwrap();
        let rejoin = Rejoin::open(
            &self.dir(id).join("raft"),
            self.joining.contains(&id) && empty,
        )
        .unwrap();
        if rejoin.holds() {
            raft.runtime_config().elect(false);
        }
        let service = Arc::new(RaftService::new(raft.clone(), handoff, snapshots, rejoin));
        let serve = peer::serve(listener, id, SECRET, PeerOptions::default(), service).unwrap();
        let serving = tokio::spawn(serve);
        let runtime = tokio::runtime::Handle::current();
        let answer_within = Duration::from_millis(500);
        let proposer = super::propose::start(
            raft.clone(),
            &log,
            self.clock.clone(),
            runtime,
            answer_within,
        )
        .unwrap()
        .unwrap();
        self.running.insert(
            id,
            Running {
                raft,
                log,
                broker,
                proposer,
                serving,
                handing_off,
            },
        );
    }

    /// The leader the running members agree on.
    async fn leader(&self) -> u64 {
        let all: Vec<_> = self.running.keys().copied().collect();
        self.leader_among(&all).await
    }

    /// The leader the running members among `ids` agree on, one of them.
    async fn leader_among(&self, ids: &[u64]) -> u64 {
        let mut leader = None;
        wait_until("the members agree on a leader", || {
            let seen: BTreeSet<_> = ids
                .iter()
                .filter_map(|id| self.running.get(id))
                .map(|r| r.raft.metrics().borrow().current_leader)
                .collect();
            leader = match seen.into_iter().collect::<Vec<_>>()[..] {
                [Some(id)] if ids.contains(&id) && self.running.contains_key(&id) => Some(id),
                _ => None,
            };
            leader.is_some()
        })
        .await;
        leader.unwrap()
    }

    /// Cuts every peer link of `id`, both ways; returns once they are closed.
    async fn isolate(&self, id: u64) {
        for (member, proxy) in &self.proxies {
            match *member == id {
                true => proxy.block(self.members.keys().copied()).await,
                false => proxy.block([id]).await,
            }
        }
    }

    fn heal(&self) {
        self.proxies.values().for_each(Proxy::heal);
    }

    /// Appends through the leader, retrying while leadership moves.
    async fn append(&self, body: &str) -> MessageId {
        for _ in 0..100 {
            let leader = self.leader().await;
            match self.running[&leader].log.append(vec![message(body)]).await {
                Ok(appended) => return appended[0].id,
                Err(AppendError::NotLeader { .. } | AppendError::Uncertain { .. }) => {}
                Err(e) => panic!("append: {e}"),
            }
        }
        panic!("no leader took the append");
    }

    /// Waits until every running member has applied (filed) the message `id`.
    async fn applied_everywhere(&self, id: MessageId, body: &str) {
        let all: Vec<_> = self.running.keys().copied().collect();
        self.applied_on(&all, id, body).await;
    }

    /// Waits until the members `ids` have applied (filed) the message `id`.
    async fn applied_on(&self, ids: &[u64], id: MessageId, body: &str) {
        for (member, running) in self.running.iter().filter(|(m, _)| ids.contains(m)) {
            let log = running.log.clone();
            let found = move || log.lookup(id).ok().flatten().map(|s| s.message.body);
            wait_until(&format!("member {member} applied {body}"), || {
                found().as_deref() == Some(body.as_bytes())
            })
            .await;
        }
    }
}

impl Cluster {
    /// Waits until every running member's dispatch logs say `id` was delivered.
    async fn delivered_everywhere(&self, id: MessageId) {
        for (member, running) in &self.running {
            let log = running.log.clone();
            let state = move || log.lookup(id).ok().flatten().map(|s| s.state);
            wait_until(&format!("member {member} has {id} delivered"), || {
                matches!(state(), Some(MessageState::Delivered { .. }))
            })
            .await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_replicate_and_survive_the_loss_of_their_leader() {
    let mut cluster = Cluster::new(3).await;
    let first = cluster.append("before").await;
    cluster.applied_everywhere(first, "before").await;
    // Its delivery is an entry too: every member's dispatch logs hold it.
    let delivered = Outcome {
        seq: first.first.seq,
        at_ms: T0 + 1,
        attempt: 0,
        kind: OutcomeKind::Delivered,
    };
    for attempt in 0.. {
        let leader = cluster.running[&cluster.leader().await].log.clone();
        let outcome = [(first.first.bucket, delivered.clone())];
        let recorded = tokio::task::spawn_blocking(move || leader.record_outcomes(&outcome))
            .await
            .unwrap();
        match recorded {
            Ok(()) => break,
            // Leadership moved (an election on a busy machine): ask the new leader.
            Err(schedulelog::Error::Append(
                AppendError::NotLeader { .. } | AppendError::Uncertain { .. },
            )) if attempt < 100 => {}
            Err(e) => panic!("recording the outcome: {e}"),
        }
    }
    cluster.delivered_everywhere(first).await;

    // The leader goes; the other two elect one and take writes.
    let old = cluster.leader().await;
    cluster.running.remove(&old).unwrap().stop().await;
    let second = cluster.append("after").await;
    assert_ne!(cluster.leader().await, old);
    cluster.applied_everywhere(second, "after").await;

    // It comes back from its data dir and catches up from the log.
    cluster.start(old).await;
    cluster.applied_everywhere(first, "before").await;
    cluster.delivered_everywhere(first).await;
    cluster.applied_everywhere(second, "after").await;

    // Every member's WAL holds the same entries.
    let logs: Vec<_> = cluster
        .running
        .values()
        .map(|r| {
            let (_, last) = r.log.entry_bounds().unwrap();
            let last = last.unwrap().index;
            r.log.read_entries(last - 1..last + 1).unwrap()
        })
        .collect();
    assert!(logs.windows(2).all(|w| w[0] == w[1]), "{logs:?}");
    for (_, running) in std::mem::take(&mut cluster.running) {
        running.stop().await;
    }
}

/// Writers keep writing while the leader is stopped twice (and restarted): every write that was
/// acknowledged is on every member afterwards, and none is lost or doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_writes_survive_leaders_stopped_under_load() {
    let mut cluster = Cluster::new(3).await;
    let mut acknowledged = Vec::new();
    for round in 0..3 {
        // A burst of concurrent writes through the leader of the moment.
        let leader = cluster.leader().await;
        let log = &cluster.running[&leader].log;
        let writes: Vec<_> = (0..20)
            .map(|i| {
                let body = format!("round {round} write {i}");
                (log.append(vec![message(&body)]), body)
            })
            .collect();
        if round < 2 {
            // The leader goes while some of them are in flight, and comes back.
            cluster.running.remove(&leader).unwrap().stop().await;
            cluster.start(leader).await;
        }
        for (ack, body) in writes {
            if let Ok(appended) = ack.await {
                acknowledged.push((appended[0].id, body));
            }
        }
    }
    assert!(!acknowledged.is_empty());
    for (id, body) in &acknowledged {
        cluster.applied_everywhere(*id, body).await;
    }
    let ids: BTreeSet<_> = acknowledged.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids.len(), acknowledged.len(), "an id was handed out twice");
    for (_, running) in std::mem::take(&mut cluster.running) {
        running.stop().await;
    }
}

/// A write larger than one entry may be is refused before it is proposed: the leader's Raft goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_larger_than_an_entry_is_refused_and_raft_goes_on() {
    let mut cluster = Cluster::new(3).await;
    let leader = cluster.leader().await;
    let big = "x".repeat(1 << 20);
    let count = schedulelog::MAX_ENTRY_BYTES / big.len() + 1;
    let messages = (0..count).map(|_| message(&big)).collect();
    let refused = cluster.running[&leader].log.append(messages).await;
    assert!(
        matches!(refused, Err(AppendError::Refused(_))),
        "{refused:?}"
    );
    let after = cluster.append("after").await;
    cluster.applied_everywhere(after, "after").await;
    let state = cluster.running[&leader]
        .raft
        .metrics()
        .borrow()
        .running_state
        .clone();
    assert!(state.is_ok(), "the member's Raft stopped: {state:?}");
    for (_, running) in std::mem::take(&mut cluster.running) {
        running.stop().await;
    }
}

/// A leader cut off from the others acknowledges nothing; the majority elects another and takes
/// writes; once healed, the old leader's uncommitted entry is cut from its WAL and replaced by the
/// majority's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_leader_loses_its_uncommitted_tail() {
    let mut cluster = Cluster::new(3).await;
    let first = cluster.append("before").await;
    cluster.applied_everywhere(first, "before").await;
    let old = cluster.leader().await;
    let (_, before) = cluster.running[&old].log.entry_bounds().unwrap();
    let before = before.unwrap().index;

    cluster.isolate(old).await;
    // No quorum takes its write: its writer is told the fate is unknown (after half a second here),
    // and a write after it is not even proposed.
    let held = cluster.running[&old].log.append(vec![message("isolated")]);
    let held = held.await;
    assert!(
        matches!(held, Err(AppendError::Uncertain { .. })),
        "{held:?}"
    );
    let refused = cluster.running[&old]
        .log
        .append(vec![message("refused")])
        .await;
    assert!(
        matches!(refused, Err(AppendError::NotLeader { .. })),
        "{refused:?}"
    );
    let majority: Vec<_> = cluster
        .members
        .keys()
        .copied()
        .filter(|id| *id != old)
        .collect();
    let new = cluster.leader_among(&majority).await;
    let taken = loop {
        match cluster.running[&new]
            .log
            .append(vec![message("majority")])
            .await
        {
            Ok(appended) => break appended[0].id,
            Err(AppendError::NotLeader { .. } | AppendError::Uncertain { .. }) => {
                cluster.leader_among(&majority).await;
            }
            Err(e) => panic!("append on the majority: {e}"),
        }
    };
    cluster.applied_on(&majority, taken, "majority").await;

    cluster.heal();
    cluster.applied_everywhere(taken, "majority").await;
    // Its entry was cut: the old leader's WAL holds the majority's entries after the shared ones.
    let logs: Vec<_> = cluster
        .running
        .values()
        .map(|r| r.log.read_entries(before + 1..before + 3).unwrap())
        .collect();
    assert!(logs.windows(2).all(|w| w[0] == w[1]), "{logs:?}");
    for (_, running) in std::mem::take(&mut cluster.running) {
        running.stop().await;
    }
}

/// The leader goes while one follower lacks its last entries. That follower stands first (the other
/// has its own elections switched off) and is refused for its shorter log; the refusing follower,
/// which holds every entry, then stands itself and leads (handoff.rs). Without the hand-off nobody
/// would lead: the one that may stand never wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_refusing_a_shorter_log_stands_itself_and_leads() {
    let mut cluster = Cluster::new(3).await;
    let first = cluster.append("shared").await;
    cluster.applied_everywhere(first, "shared").await;
    let old = cluster.leader().await;
    let mut followers = cluster.members.keys().copied().filter(|id| *id != old);
    let (behind, ahead) = (followers.next().unwrap(), followers.next().unwrap());
    // The leader's link to `behind` is cut: the next entry is committed with `ahead` alone.
    cluster.proxies[&behind].block([old]).await;
    cluster.proxies[&old].block([behind]).await;
    let last = cluster.append("only ahead").await;
    cluster.applied_on(&[old, ahead], last, "only ahead").await;
    cluster.running[&ahead].raft.runtime_config().elect(false);

    cluster.running.remove(&old).unwrap().stop().await;
    cluster.heal();
    let new = cluster.leader_among(&[behind, ahead]).await;
    assert_eq!(new, ahead, "the member with the longer log leads");
    cluster
        .applied_on(&[behind, ahead], last, "only ahead")
        .await;
    for (_, running) in std::mem::take(&mut cluster.running) {
        running.stop().await;
    }
}

/// A follower cut off from the leader stands again and again, and is refused by the other, which has
/// a longer log but still hears from the leader: that one does not stand (handoff.rs waits until no
/// leader has spoken for an election timeout), and the leader leads on in its term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_hears_its_leader_does_not_stand_after_refusing_a_shorter_log() {
    let mut cluster = Cluster::new(3).await;
    let first = cluster.append("shared").await;
    cluster.applied_everywhere(first, "shared").await;
    let leader = cluster.leader().await;
    let term = |id: u64| cluster.running[&id].raft.metrics().borrow().current_term;
    let before = term(leader);
    let mut followers = cluster.members.keys().copied().filter(|id| *id != leader);
    let (behind, heard) = (followers.next().unwrap(), followers.next().unwrap());
    cluster.proxies[&behind].block([leader]).await;
    cluster.proxies[&leader].block([behind]).await;
    // `heard` has an entry `behind` lacks: `behind`'s campaigns are refused for their shorter log.
    let last = cluster.append("only heard").await;
    cluster
        .applied_on(&[leader, heard], last, "only heard")
        .await;
    wait_until("the cut-off follower stood twice", || {
        term(behind) >= before + 2
    })
    .await;
    assert_eq!(term(leader), before, "the leader leads on in its term");
    assert_eq!(
        term(heard),
        before,
        "the follower that hears its leader stood for nothing"
    );
    assert_eq!(cluster.leader_among(&[leader, heard]).await, leader);
    cluster.heal();
    for (_, running) in std::mem::take(&mut cluster.running) {
        running.stop().await;
    }
}

/// A keyed write that the leader answers as uncertain (its followers do not answer in time), and
/// that is committed afterwards in the same term, is not scheduled a second time when its client
/// sends it again: until the intake finds it filed the key is refused as unsettled, then the message
/// is found pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_write_answered_uncertain_is_not_scheduled_twice_when_it_commits_later() {
    use crate::intake::{Admission, Intake, IntakeError, Keyed, MessageKey};
    let mut cluster = Cluster::new(3).await;
    let first = cluster.append("shared").await;
    cluster.applied_everywhere(first, "shared").await;
    let leader = cluster.leader().await;
    let term = cluster.running[&leader]
        .raft
        .metrics()
        .borrow()
        .current_term;
    let log = cluster.running[&leader].log.clone();
    let scheduler = Arc::new(
        crate::scheduler::Scheduler::start(
            log.clone(),
            &crate::sink::SinkRegistry::new(),
            crate::scheduler::SchedulerConfig::default(),
            cluster.clock.clone(),
            &tokio::runtime::Handle::current(),
        )
        .unwrap(),
    );
    let disk = Arc::new(crate::disk::DiskWatch::new(cluster.dir(leader).into(), 0));
    let opened = {
        let (log, scheduler, clock) = (log.clone(), scheduler.clone(), cluster.clock.clone());
        tokio::task::spawn_blocking(move || {
            Intake::open(log, scheduler, Admission::default(), clock, disk)
        })
    };
    let intake = opened.await.unwrap().unwrap();
    let key = MessageKey {
        sink: "broker".into(),
        topic: "orders.timeout".into(),
        key: "order-42".into(),
    };
    let keyed = || {
        NewMessage {
            deliver_at_ms: T0 + 3_600_000,
            topic: key.topic.clone(),
            sink: key.sink.clone(),
            key: Some(key.key.clone()),
            dedup: true,
            body: b"cancel order 42".to_vec(),
            ..NewMessage::default()
        }
        .encode()
        .unwrap()
    };

    // The followers hear nothing from the leader for a while (and stand for nothing meanwhile).
    let followers: Vec<u64> = (cluster.members.keys().copied())
        .filter(|id| *id != leader)
        .collect();
    for follower in &followers {
        cluster.running[follower].raft.runtime_config().elect(false);
        cluster.proxies[follower].block([leader]).await;
    }
    let answered = intake.schedule_keyed(&key, keyed()).await;
    assert!(
        matches!(
            answered,
            Err(IntakeError::Append(AppendError::Uncertain { .. }))
        ),
        "{answered:?}"
    );
    let again = intake.schedule_keyed(&key, keyed()).await;
    assert!(matches!(again, Err(IntakeError::KeyUnsettled)), "{again:?}");

    // The links come back: the write is committed in the same term, and found, not made again.
    cluster.heal();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let found = loop {
        match intake.schedule_keyed(&key, keyed()).await {
            Err(IntakeError::KeyUnsettled) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the key stays unsettled"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(Keyed::Pending(id, _)) => break id,
            other => panic!("sent again, the keyed write was {other:?}"),
        }
    };
    assert_eq!(
        cluster.running[&leader]
            .raft
            .metrics()
            .borrow()
            .current_term,
        term,
        "the same term"
    );
    assert_eq!(intake.pending_with_key(&key).await.unwrap(), Some(found));
    scheduler.shutdown().await;
    drop((intake, scheduler, log));
    for (_, running) in std::mem::take(&mut cluster.running) {
        running.stop().await;
    }
}

fn delivered(topic: &str, key: Option<&str>, body: &[u8]) -> Incoming {
    Incoming {
        topic: topic.into(),
        id: format!("id-{}", String::from_utf8_lossy(body)),
        key: key.map(String::from),
        headers: [("h".to_string(), "v".to_string())].into(),
        deliver_at_ms: T0,
        delivered_at_ms: T0 + 1,
        attempt: 0,
        attempt_at: None,
        body: body.to_vec(),
    }
}

impl Cluster {
    /// Appends to the leader's broker (as its `broker` sink does), retrying while leadership moves.
    async fn broker_append(&self, messages: Vec<Incoming>) -> Vec<(u32, u64)> {
        for _ in 0..100 {
            let broker = self.running[&self.leader().await].broker.clone();
            let batch = messages.clone();
            match tokio::task::spawn_blocking(move || broker.append(batch))
                .await
                .unwrap()
            {
                Ok(placed) => return placed,
                Err(BrokerError::Replication(AppendError::NotLeader { .. })) => {}
                Err(e) => panic!("broker append: {e}"),
            }
        }
        panic!("no leader took the broker append");
    }

    /// Commits a consumer group's offset through the leader's broker, retrying while leadership moves.
    async fn commit_offset(&self, group: &str, topic: &str, queue: u32, offset: u64) {
        for _ in 0..100 {
            let broker = self.running[&self.leader().await].broker.clone();
            let (g, t) = (group.to_string(), topic.to_string());
            let committed =
                tokio::task::spawn_blocking(move || broker.commit_offset(&g, &t, queue, offset, 8))
                    .await
                    .unwrap();
            match committed {
                Ok(()) => return,
                Err(crate::broker::CommitError::Broker(BrokerError::Replication(
                    AppendError::NotLeader { .. },
                ))) => {}
                Err(e) => panic!("commit offset: {e}"),
            }
        }
        panic!("no leader took the offset commit");
    }

    /// Waits until every running member's broker holds `body` at `offset` of `queue` of `topic`, and
    /// returns what they hold there (the same on each).
    async fn in_every_broker(&self, topic: &str, queue: u32, offset: u64, body: &[u8]) {
        let mut seen = Vec::new();
        for (member, running) in &self.running {
            let broker = running.broker.clone();
            let read = || {
                let pulled = broker.read(topic, queue, offset, 1).ok().flatten()?;
                pulled.messages.into_iter().next()
            };
            wait_until(
                &format!("member {member} stored {offset} of {topic}/{queue}"),
                || read().is_some_and(|m| m.offset == offset && m.body == body),
            )
            .await;
            seen.push(read().unwrap());
        }
        assert!(seen.windows(2).all(|w| w[0] == w[1]), "{seen:?}");
    }
}

/// The built-in broker through Raft: a batch appended through the leader's broker and an offset
/// committed there are in every member's broker files, in the same queue at the same offset, byte
/// for byte; after the leader is stopped, another takes appends at the next offsets, and the offset
/// is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_is_replicated_and_outlives_its_leader() {
    let mut cluster = Cluster::new(3).await;
    let binary = [0u8, 255, 10, 34];
    let placed = cluster
        .broker_append(vec![
            delivered("orders", Some("k"), b"first"),
            delivered("orders", Some("k"), &binary),
            delivered("orders", None, b"unkeyed"),
        ])
        .await;
    let queue = placed[0].0;
    assert_eq!(placed[..2], [(queue, 0), (queue, 1)], "one key, one queue");
    cluster.in_every_broker("orders", queue, 0, b"first").await;
    cluster.in_every_broker("orders", queue, 1, &binary).await;
    let (unkeyed_queue, unkeyed_offset) = placed[2];
    cluster
        .in_every_broker("orders", unkeyed_queue, unkeyed_offset, b"unkeyed")
        .await;
    cluster.commit_offset("readers", "orders", queue, 1).await;
    for (member, running) in &cluster.running {
        let broker = running.broker.clone();
        wait_until(&format!("member {member} has the offset"), || {
            broker.group_offsets("readers", "orders") == BTreeMap::from([(queue, 1)])
        })
        .await;
    }
    // Every member made the topic alike.
    let topics: BTreeSet<_> = cluster
        .running
        .values()
        .map(|r| (r.broker.topics(), r.broker.queue_offsets("orders")))
        .collect();
    assert_eq!(topics.len(), 1, "{topics:?}");

    // The leader goes; another is elected and takes appends at the next offsets.
    let old = cluster.leader().await;
    cluster.running.remove(&old).unwrap().stop().await;
    let after = cluster
        .broker_append(vec![delivered("orders", Some("k"), b"after")])
        .await;
    assert_ne!(cluster.leader().await, old);
    assert_eq!(after, [(queue, 2)]);
    cluster.in_every_broker("orders", queue, 1, &binary).await;
    cluster.in_every_broker("orders", queue, 2, b"after").await;
    for running in cluster.running.values() {
        assert_eq!(
            running.broker.group_offsets("readers", "orders"),
            BTreeMap::from([(queue, 1)])
        );
    }
    // It comes back and catches up: its broker ends where the others' do.
    cluster.start(old).await;
    cluster.in_every_broker("orders", queue, 2, b"after").await;
    let ends: BTreeSet<_> = cluster
        .running
        .values()
        .map(|r| r.broker.queue_offsets("orders"))
        .collect();
    assert_eq!(ends.len(), 1, "{ends:?}");
    for (_, running) in std::mem::take(&mut cluster.running) {
        running.stop().await;
    }
}

impl Cluster {
    /// Replaces a source's state file through the leader (as its sources do), retrying while
    /// leadership moves; returns the member that took it.
    async fn replace_state_file(&self, file: &str, content: &[u8]) -> u64 {
        for _ in 0..100 {
            let leader = self.leader().await;
            let files = StateFiles::replicated(self.dir(leader), &self.running[&leader].log);
            let (name, bytes) = (file.to_string(), content.to_vec());
            let replaced = tokio::task::spawn_blocking(move || files.replace(&name, &bytes))
                .await
                .unwrap();
            match replaced {
                Ok(()) => return leader,
                Err(StateFileError::Replication {
                    source: AppendError::NotLeader { .. } | AppendError::Uncertain { .. },
                    ..
                }) => {}
                Err(e) => panic!("replacing {file}: {e}"),
            }
        }
        panic!("no leader took the state file");
    }

    /// A member's `sources/{file}`, if it has one.
    fn state_file(&self, id: u64, file: &str) -> Option<Vec<u8>> {
        std::fs::read(self.dir(id).join("sources").join(file)).ok()
    }

    /// Waits until every running member's `sources/{file}` holds `content`.
    async fn state_file_everywhere(&self, file: &str, content: &[u8]) {
        for member in self.running.keys() {
            wait_until(&format!("member {member} has {file}"), || {
                self.state_file(*member, file).as_deref() == Some(content)
            })
            .await;
        }
    }
}

/// The sources' state files through Raft (DESIGN.md §10): a mark replaced through the leader is in
/// its `sources/` when the call returns, and then in every member's, byte for byte, among the
/// broker's ops of the same log; a member stopped meanwhile catches up when it comes back, and the
/// entries a restart applies again leave the same file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_state_files_are_the_same_on_every_member() {
    let mut cluster = Cluster::new(3).await;
    let first = br#"{"below":42,"unacked":[["1700000000000-0",41]]}"#;
    let took = cluster.replace_state_file("orders-in", first).await;
    assert_eq!(
        cluster.state_file(took, "orders-in").as_deref(),
        Some(&first[..]),
        "applied on the member that proposed it once the call returned"
    );
    cluster.state_file_everywhere("orders-in", first).await;

    // A follower goes; a newer mark, a Kafka source's epochs and a broker append go through the
    // other two.
    let leader = cluster.leader().await;
    let away = *cluster.running.keys().find(|id| **id != leader).unwrap();
    cluster.running.remove(&away).unwrap().stop().await;
    let newer = br#"{"below":97,"unacked":[]}"#;
    cluster.replace_state_file("orders-in", newer).await;
    let epochs = br#"{"delayd-in/0":{"epoch":0,"committed":true}}"#;
    let epochs_file = "orders-in~kafka-epochs";
    cluster.replace_state_file(epochs_file, epochs).await;
    let placed = cluster
        .broker_append(vec![delivered("orders", Some("k"), b"beside")])
        .await;
    cluster.state_file_everywhere("orders-in", newer).await;
    assert_eq!(
        cluster.state_file(away, "orders-in").as_deref(),
        Some(&first[..])
    );

    // It comes back and catches up; then every member restarts, applying the entries past its
    // checkpoint again: the same files.
    cluster.start(away).await;
    cluster.state_file_everywhere("orders-in", newer).await;
    cluster.state_file_everywhere(epochs_file, epochs).await;
    let (queue, offset) = placed[0];
    cluster
        .in_every_broker("orders", queue, offset, b"beside")
        .await;
    for id in cluster.members.keys().copied().collect::<Vec<_>>() {
        cluster.running.remove(&id).unwrap().stop().await;
        cluster.start(id).await;
    }
    cluster.leader().await;
    cluster.state_file_everywhere("orders-in", newer).await;
    cluster.state_file_everywhere(epochs_file, epochs).await;
    for id in cluster.members.keys() {
        let names: Vec<_> = std::fs::read_dir(cluster.dir(*id).join("sources"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        assert_eq!(
            names,
            ["orders-in", "orders-in~kafka-epochs"],
            "member {id}"
        );
    }
    for (_, running) in std::mem::take(&mut cluster.running) {
        running.stop().await;
    }
}

/// A member restarted on an empty data dir to join (its disk lost) refuses votes until it has caught
/// up: it holds none of the entries it acknowledged, and forgot its vote. Once the others reach it, it
/// catches up from the leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_restarted_empty_to_join_refuses_votes_until_caught_up() {
    use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
    use openraft::raft::VoteRequest;
    let mut cluster = Cluster::new(3).await;
    let before = cluster.append("before").await;
    cluster.applied_everywhere(before, "before").await;
    let leader = cluster.leader().await;
    let lost = (1..=3).find(|&m| m != leader).unwrap();
    cluster.running.remove(&lost).unwrap().stop().await;
    for entry in std::fs::read_dir(cluster.dir(lost)).unwrap() {
        let path = entry.unwrap().path();
        match path.is_dir() {
            true => std::fs::remove_dir_all(&path).unwrap(),
            false => std::fs::remove_file(&path).unwrap(),
        }
    }
    cluster.isolate(lost).await;
    cluster.joining.insert(lost);
    cluster.start(lost).await;

    // A candidate with the leader's log, in a later term, straight to the member's own listener.
    let (term, last) = {
        let running = &cluster.running[&leader];
        let last = running.log.entry_bounds().unwrap().1.unwrap();
        (
            running.raft.metrics().borrow().current_term,
            super::store::to_raft_log_id(last),
        )
    };
    let mut network = PeerNetwork::new(leader, SECRET, PeerOptions::default()).unwrap();
    let straight = Member {
        api: "http://127.0.0.1:1".into(),
        peer: cluster.peers[(lost - 1) as usize].to_string(),
    };
    let mut client = network.new_client(lost, &straight).await;
    let request = VoteRequest::new(openraft::Vote::new(term + 5, leader), Some(last));
    let answer = client
        .vote(request, RPCOption::new(Duration::from_secs(5)))
        .await
        .unwrap();
    assert!(
        !answer.vote_granted,
        "an empty joiner votes for nobody: {answer:?}"
    );

    cluster.heal();
    cluster.applied_on(&[lost], before, "before").await;
    // Caught up: the hold ends (its file goes), and the member votes again.
    let hold = cluster
        .dir(lost)
        .join("raft")
        .join(super::rejoin::REJOIN_FILE);
    wait_until("the hold ends", || !hold.exists()).await;
    for (_, running) in std::mem::take(&mut cluster.running) {
        running.stop().await;
    }
}
