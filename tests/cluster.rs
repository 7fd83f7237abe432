//! The cluster as processes (DESIGN.md §10): three `delayd serve` members on loopback, each with its
//! own data dir and config, delivering to a webhook receiver the test runs. Each member's sink calls
//! the receiver at a path of its own (`/hooks/{member}`), so the receiver knows who delivered.
//!
//! A binary of its own: its members take most of the machine while they run, and it must not run beside
//! the parallel integration tests (`cargo test` runs test binaries one after another).

#![allow(clippy::unwrap_used, reason = "tests stop at the first failure")]

#[path = "common/mod.rs"]
mod common;

use axum::extract::{Path as UrlPath, State};
use axum::http::HeaderMap;
use common::redis_server::RedisServer;
use common::sidecar::{source_count, Mq};
use common::{agent, now_ms, request, scrape, spawn_member, wait_for, Process};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const SECRET: &str = "a long random secret for the cluster tests";
const HOOK_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const READY: Duration = Duration::from_secs(60);
/// The webhook sink's calls at once, and messages a call: what a leader may have handed over and not
/// yet recorded when it dies.
const IN_FLIGHT: u64 = 4;
const BATCH: u64 = 64;

/// A delivery the receiver got.
#[derive(Debug, Clone)]
struct Hit {
    /// The member that delivered it.
    member: u64,
    /// Its `webhook-id`: the message's id, the same on every attempt.
    id: String,
    body: String,
    at_ms: i64,
    /// A firing's `delayd-fire-at` (recurring schedules, DESIGN §14), as unix ms.
    fire_at: Option<i64>,
}

/// The webhook receiver: records every delivery, answers 204.
struct Receiver {
    url: String,
    hits: Arc<Mutex<Vec<Hit>>>,
    runtime: tokio::runtime::Runtime,
}

async fn receive(
    State(hits): State<Arc<Mutex<Vec<Hit>>>>,
    UrlPath(member): UrlPath<u64>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> axum::http::StatusCode {
    let id = headers.get("webhook-id").and_then(|v| v.to_str().ok());
    let fire_at = (headers.get("delayd-fire-at"))
        .and_then(|v| delayd::timestamp::parse_rfc3339(v.to_str().ok()?));
    hits.lock().unwrap().push(Hit {
        member,
        id: id.unwrap_or_default().to_string(),
        body: String::from_utf8_lossy(&body).into_owned(),
        at_ms: now_ms(),
        fire_at,
    });
    axum::http::StatusCode::NO_CONTENT
}

impl Receiver {
    fn start() -> Receiver {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let hits = Arc::new(Mutex::new(Vec::new()));
        let app = axum::Router::new()
            .route("/hooks/{member}", axum::routing::post(receive))
            .with_state(hits.clone());
        runtime.spawn(async move { axum::serve(listener, app).await });
        Receiver { url, hits, runtime }
    }

    fn hits(&self) -> Vec<Hit> {
        self.hits.lock().unwrap().clone()
    }
}

/// A TCP proxy in front of one member's peer listener, which the other members call it through. It
/// refuses links from chosen callers (read from the peer handshake's first bytes: magic, version,
/// the caller's id) and cuts theirs at once: a partition the test controls.
struct Proxy {
    port: u16,
    blocked: tokio::sync::watch::Sender<BTreeSet<u64>>,
}

impl Proxy {
    fn start(runtime: &tokio::runtime::Runtime, target: u16) -> Proxy {
        use tokio::io::AsyncReadExt;
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let (blocked, watch) = tokio::sync::watch::channel(BTreeSet::new());
        runtime.spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    continue;
                };
                let mut watch = watch.clone();
                tokio::spawn(async move {
                    let mut hello = [0u8; 18];
                    if inbound.read_exact(&mut hello).await.is_err() {
                        return;
                    }
                    let caller = u64::from_le_bytes(hello[10..18].try_into().unwrap());
                    let cut = |blocked: &BTreeSet<u64>| blocked.contains(&caller);
                    if cut(&watch.borrow_and_update()) {
                        return;
                    }
                    let Ok(mut outbound) =
                        tokio::net::TcpStream::connect(("127.0.0.1", target)).await
                    else {
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
        Proxy { port, blocked }
    }
}

/// One member: its ports, data dir and config, and its process while it runs.
struct Member {
    id: u64,
    api: String,
    dir: tempfile::TempDir,
    config: PathBuf,
    process: Option<Process>,
}

struct Cluster {
    members: Vec<Member>,
    /// In front of each member's peer listener, by member: the address the others call it at.
    proxies: Vec<Proxy>,
    receiver: Receiver,
    /// Held while the cluster runs; dropped last, after its members are killed.
    _serial: std::sync::MutexGuard<'static, ()>,
}

/// A loopback port for a member's listener, free when asked, below the kernel's ephemeral range
/// (32768 and up here): a member binds its port again when it restarts, and a port the kernel may
/// hand out meanwhile (to a proxy bound to port 0, or as the source port of any connection) would
/// then be taken. Below that range only explicit binds take a port, and the ports handed out here
/// are never handed out twice by one test process.
fn member_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let (low, span) = (20_000, 12_000);
    let start = std::process::id() % span;
    loop {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        assert!(n < span, "no free port below the ephemeral range");
        let port = (low + (start + n * 7) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// One cluster at a time: three members each take a good part of the machine, and the tests of this
/// binary would otherwise run side by side (cargo runs a binary's tests on parallel threads).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

impl Cluster {
    /// Starts `size` members and waits until each is ready (a leader is elected and known).
    fn start(size: u64) -> Cluster {
        Cluster::start_with(size, "")
    }

    /// [`Cluster::start`] with `tables` (TOML: sources, more sinks) in every member's config.
    fn start_with(size: u64, tables: &str) -> Cluster {
        Cluster::start_configured(size, tables, "")
    }

    /// [`Cluster::start_with`], with `cluster_keys` (TOML) in every member's `[cluster]` section.
    fn start_configured(size: u64, tables: &str, cluster_keys: &str) -> Cluster {
        let mut cluster = Cluster::prepare(size, size, tables, cluster_keys);
        for id in 1..=size {
            cluster.launch(id);
        }
        for id in 1..=size {
            cluster
                .member(id)
                .process
                .as_mut()
                .unwrap()
                .wait_ready_within(READY);
        }
        cluster
    }

    /// `size` members, none running: the first `founders` found the cluster (each lists them), the
    /// others are to be added to it (each lists every member, and has `join = true`).
    fn prepare(size: u64, founders: u64, tables: &str, cluster_keys: &str) -> Cluster {
        let serial = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let receiver = Receiver::start();
        let ports: Vec<(u16, u16)> = (0..size).map(|_| (member_port(), member_port())).collect();
        let proxies: Vec<Proxy> = (ports.iter())
            .map(|(_, peer)| Proxy::start(&receiver.runtime, *peer))
            .collect();
        let mut everyone = String::new();
        let mut founding = String::new();
        for (i, ((api, _), proxy)) in ports.iter().zip(&proxies).enumerate() {
            let table = format!(
                "[[cluster.members]]\nid = {}\napi = \"http://127.0.0.1:{api}\"\npeer = \"127.0.0.1:{}\"\n",
                i + 1,
                proxy.port
            );
            everyone.push_str(&table);
            if (i as u64) < founders {
                founding.push_str(&table);
            }
        }
        let members: Vec<Member> = (1..=size)
            .zip(&ports)
            .map(|(id, (api, peer))| {
                let (roster, join) = match id <= founders {
                    true => (&founding, ""),
                    false => (&everyone, "join = true"),
                };
                let dir = tempfile::tempdir().unwrap();
                let text = format!(
                    "listen = \"127.0.0.1:{api}\"\n\
                     [limits]\nmin_free_disk_bytes = 0\n\
                     [sinks.hook]\nkind = \"webhook\"\nurl = \"{}/hooks/{id}\"\nsecret = \"{HOOK_SECRET}\"\nmax_in_flight = {IN_FLIGHT}\nmax_batch = {BATCH}\n\
                     {tables}\n\
                     [cluster]\nnode_id = {id}\nlisten = \"127.0.0.1:{peer}\"\nsecret = \"{SECRET}\"\nelection_timeout = \"1s\"\n{cluster_keys}\n{join}\n{roster}",
                    receiver.url
                );
                let config = common::write_file(dir.path(), "delayd.toml", &text);
                Member {
                    id,
                    api: format!("http://127.0.0.1:{api}"),
                    dir,
                    config,
                    process: None,
                }
            })
            .collect();
        Cluster {
            members,
            proxies,
            receiver,
            _serial: serial,
        }
    }

    fn member(&mut self, id: u64) -> &mut Member {
        &mut self.members[(id - 1) as usize]
    }

    fn launch(&mut self, id: u64) {
        let member = self.member(id);
        let data = member.dir.path().join("data");
        let process = spawn_member(&member.config, &data, &[("RUST_LOG", "info,openraft=warn")]);
        assert_eq!(process.base, member.api);
        member.process = Some(process);
    }

    /// Cuts every peer link of member `id`, both ways, and keeps them cut until [`Cluster::heal`].
    fn isolate(&self, id: u64) {
        let all: BTreeSet<u64> = self.members.iter().map(|m| m.id).collect();
        for (member, proxy) in self.members.iter().zip(&self.proxies) {
            match member.id == id {
                true => proxy.blocked.send_replace(all.clone()),
                false => proxy.blocked.send_replace(BTreeSet::from([id])),
            };
        }
    }

    fn heal(&self) {
        for proxy in &self.proxies {
            proxy.blocked.send_replace(BTreeSet::new());
        }
    }

    /// Waits until every running member has applied what the leader had committed when asked.
    fn caught_up(&self) {
        let leader = self.leader();
        let committed = cluster_status(&self.members[(leader - 1) as usize].api)["commit_index"]
            .as_u64()
            .unwrap_or(0);
        for id in self.running() {
            let api = &self.members[(id - 1) as usize].api;
            wait_for("every member caught up with the leader", READY, || {
                cluster_status(api)["applied_index"]
                    .as_u64()
                    .is_some_and(|applied| applied >= committed)
            });
        }
    }

    fn running(&self) -> Vec<u64> {
        (self.members.iter())
            .filter(|m| m.process.is_some())
            .map(|m| m.id)
            .collect()
    }

    /// The leader every running member names, once they agree.
    fn leader(&self) -> u64 {
        let mut leader = 0;
        wait_for("the running members agree on a leader", READY, || {
            let named: BTreeSet<Option<u64>> = (self.running().into_iter())
                .map(|id| {
                    cluster_status(&self.members[(id - 1) as usize].api)["leader_id"].as_u64()
                })
                .collect();
            match named.into_iter().collect::<Vec<_>>()[..] {
                [Some(id)] if self.running().contains(&id) => {
                    leader = id;
                    true
                }
                _ => false,
            }
        });
        leader
    }
}

impl Cluster {
    /// The end of a run under load: waits for a write acknowledged after `since` (unix ms), stops
    /// the writers, checks that every acknowledged message was delivered (none early), and once the
    /// running members caught up, stops them and checks that they hold the same files.
    fn finish(&mut self, writers: Writers, since: i64) {
        let last_ack = writers.last_ack.clone();
        wait_for("a write acknowledged after the last change", READY, || {
            last_ack.load(Ordering::SeqCst) > since + 100
        });
        let acknowledged = writers.stop();
        self.delivered_all(&acknowledged);
        println!(
            "{} messages acknowledged, all delivered",
            acknowledged.len()
        );
        self.caught_up();
        let left = self.running();
        for &id in &left {
            let status = self.member(id).process.as_mut().unwrap().terminate();
            assert!(status.success(), "member {id} stopped with {status}");
        }
        self.same_files(&left);
    }

    /// Checks that the (stopped) members `ids` hold the same schedule segments and dispatch logs,
    /// byte for byte, and that outcomes were filed.
    fn same_files(&self, ids: &[u64]) {
        let files = |id: u64| -> BTreeMap<String, Vec<u8>> {
            let data = self.members[(id - 1) as usize].dir.path().join("data");
            let mut files = BTreeMap::new();
            for sub in ["schedule", "dispatch"] {
                for entry in std::fs::read_dir(data.join(sub)).unwrap() {
                    let path = entry.unwrap().path();
                    let name = format!("{sub}/{}", path.file_name().unwrap().to_string_lossy());
                    files.insert(name, std::fs::read(&path).unwrap());
                }
            }
            files
        };
        let first = files(ids[0]);
        assert!(
            first.keys().any(|name| name.starts_with("dispatch/")),
            "outcomes were filed: {:?}",
            first.keys().collect::<Vec<_>>()
        );
        for &id in &ids[1..] {
            let other = files(id);
            assert_eq!(
                first.keys().collect::<Vec<_>>(),
                other.keys().collect::<Vec<_>>(),
                "member {id}'s files"
            );
            for (name, bytes) in &first {
                assert!(
                    other[name] == *bytes,
                    "member {id}'s {name} differs from member {}'s",
                    ids[0]
                );
            }
        }
    }

    /// Waits until every message in `acknowledged` (body → due time) was delivered; checks that
    /// none was delivered early.
    fn delivered_all(&self, acknowledged: &BTreeMap<String, i64>) {
        let latest_due = acknowledged.values().copied().max().unwrap();
        wait_for(
            "every acknowledged message delivered",
            Duration::from_secs(90),
            || {
                let delivered: BTreeSet<String> =
                    self.receiver.hits().into_iter().map(|h| h.body).collect();
                now_ms() > latest_due && acknowledged.keys().all(|b| delivered.contains(b))
            },
        );
        for hit in self.receiver.hits() {
            assert!(hit.at_ms >= due_of(&hit.body), "never early: {hit:?}");
        }
    }
}

/// Client threads sending batches of 10 messages (due within 2 s) to the members, to another member
/// after any failure (refused, uncertain, down), remembering what was acknowledged.
struct Writers {
    /// Body → due time of every message acknowledged.
    acknowledged: Arc<Mutex<BTreeMap<String, i64>>>,
    /// When the last batch was acknowledged (unix ms; 0 before the first).
    last_ack: Arc<AtomicI64>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Writers {
    /// `threads` writers to `apis`, each message's body padded with `pad` bytes, for the webhook.
    fn start(apis: Vec<String>, threads: u64, pad: usize) -> Writers {
        Writers::start_to(apis, threads, pad, "hook")
    }

    /// [`Writers::start`] for the sink `sink`.
    fn start_to(apis: Vec<String>, threads: u64, pad: usize, sink: &'static str) -> Writers {
        let acknowledged: Arc<Mutex<BTreeMap<String, i64>>> = Arc::default();
        let last_ack = Arc::new(AtomicI64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..threads)
            .map(|w| {
                let (apis, acknowledged, last_ack, stop) = (
                    apis.clone(),
                    acknowledged.clone(),
                    last_ack.clone(),
                    stop.clone(),
                );
                std::thread::spawn(move || {
                    // A client gives up on a member that does not answer (a paused one) after a while.
                    let agent = agent(Duration::from_secs(3));
                    let padding = "x".repeat(pad);
                    let mut n = 0u64;
                    let mut target = w as usize;
                    while !stop.load(Ordering::SeqCst) {
                        let batch: Vec<Value> = (0..10)
                            .map(|i| {
                                let due = now_ms() + 500 + (i as i64 * 150);
                                let mut m = message(w * 1_000_000 + n + i, due);
                                m["sink"] = sink.into();
                                m["body"] =
                                    format!("{padding}{}", m["body"].as_str().unwrap()).into();
                                m
                            })
                            .collect();
                        let url = format!("{}/v1/messages/batch", apis[target % apis.len()]);
                        let body = json!({ "messages": batch }).to_string();
                        let sent = agent
                            .post(&url)
                            .header("Content-Type", "application/json")
                            .send(&body);
                        match sent {
                            Ok(response) if response.status().is_success() => {
                                let mut acked = acknowledged.lock().unwrap();
                                for m in &batch {
                                    let body = m["body"].as_str().unwrap().to_string();
                                    acked.insert(body.clone(), due_of(&body));
                                }
                                last_ack.store(now_ms(), Ordering::SeqCst);
                                n += 10;
                            }
                            _ => {
                                target += 1;
                                std::thread::sleep(Duration::from_millis(50));
                            }
                        }
                    }
                })
            })
            .collect();
        Writers {
            acknowledged,
            last_ack,
            stop,
            threads,
        }
    }

    /// Stops the writers; what they had acknowledged.
    fn stop(self) -> BTreeMap<String, i64> {
        self.stop.store(true, Ordering::SeqCst);
        for thread in self.threads {
            thread.join().unwrap();
        }
        let acknowledged = self.acknowledged.lock().unwrap().clone();
        acknowledged
    }
}

/// `GET /v1/cluster` of the member at `base` (Null when it does not answer).
fn cluster_status(base: &str) -> Value {
    match agent(Duration::from_secs(2))
        .get(&format!("{base}/v1/cluster"))
        .call()
    {
        Ok(mut response) if response.status() == 200 => {
            serde_json::from_str(&response.body_mut().read_to_string().unwrap()).unwrap()
        }
        _ => Value::Null,
    }
}

/// A message for the webhook whose body names it and its due time.
fn message(n: u64, due_ms: i64) -> Value {
    json!({"topic": "orders", "sink": "hook", "deliver_at": rfc3339(due_ms), "body": format!("m{n}@{due_ms}")})
}

fn rfc3339(ms: i64) -> String {
    let at = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).unwrap();
    at.format(&time::format_description::well_known::Rfc3339)
        .unwrap()
}

/// The due time a body names.
fn due_of(body: &str) -> i64 {
    body.split_once('@').unwrap().1.parse().unwrap()
}

#[test]
fn members_form_a_cluster_any_member_answers_and_only_the_leader_delivers() {
    let cluster = Cluster::start(3);
    let leader = cluster.leader();
    let status = cluster_status(&cluster.members[0].api);
    assert_eq!(status["members"].as_array().unwrap().len(), 3, "{status}");
    assert!(status["term"].as_u64().unwrap() >= 1, "{status}");
    let on_leader = cluster_status(&cluster.members[(leader - 1) as usize].api);
    let states: Vec<&str> = (on_leader["members"].as_array().unwrap().iter())
        .map(|m| m["state"].as_str().unwrap())
        .collect();
    assert_eq!(
        states.iter().filter(|s| **s == "leader").count(),
        1,
        "{on_leader}"
    );
    assert!(
        (on_leader["members"].as_array().unwrap().iter()).all(|m| m["matched_index"].is_u64()),
        "the leader knows what each member holds: {on_leader}"
    );
    // The answer has the fields the OpenAPI document gives it (served through any member).
    let mut doc = Value::Null;
    wait_for("the OpenAPI document", READY, || {
        let answer = request(&cluster.members[0].api, "GET", "/openapi.json", None, None);
        doc = answer.json;
        answer.status == 200
    });
    let schemas = &doc["components"]["schemas"];
    let fields = |schema: &Value| -> BTreeSet<String> {
        schema["properties"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect()
    };
    let keys = |answer: &Value| -> BTreeSet<String> {
        answer.as_object().unwrap().keys().cloned().collect()
    };
    assert_eq!(fields(&schemas["ClusterStatus"]), keys(&on_leader));
    for member in on_leader["members"].as_array().unwrap() {
        assert_eq!(fields(&schemas["MemberStatus"]), keys(member));
    }

    // A message through each member: followers forward to the leader (an election on a busy
    // machine is answered 503, and the client sends again).
    let term = status["term"].as_u64().unwrap();
    let due = now_ms() + 1_500;
    for (n, member) in cluster.members.iter().enumerate() {
        let body = message(n as u64, due).to_string();
        wait_for("the message taken", READY, || {
            let answer = request(&member.api, "POST", "/v1/messages", Some(&body), None);
            assert!(matches!(answer.status, 200..300 | 503), "{answer:?}");
            answer.status != 503
        });
    }
    wait_for("three deliveries", READY, || {
        cluster.receiver.hits().len() >= 3
    });
    let hits = cluster.receiver.hits();
    let bodies: BTreeSet<&str> = hits.iter().map(|h| h.body.as_str()).collect();
    assert_eq!(bodies.len(), 3, "each once: {hits:?}");
    let reelected = cluster_status(&cluster.members[0].api)["term"].as_u64() != Some(term);
    for hit in &hits {
        // (Unless a new election came between: then another member may have delivered some.)
        if !reelected {
            assert_eq!(hit.member, leader, "only the leader delivers: {hit:?}");
        }
        assert!(hit.at_ms >= due_of(&hit.body), "never early: {hit:?}");
    }
    // Whichever member is asked, the answer is the leader's: the three are delivered.
    for member in &cluster.members {
        wait_for("the deliveries recorded", READY, || {
            let path = "/v1/messages?status=delivered";
            let listed = request(&member.api, "GET", path, None, None);
            assert_eq!(listed.status, 200, "{listed:?}");
            listed.json["messages"].as_array().unwrap().len() == 3
        });
    }
    let mut forwarded = 0.0;
    for member in &cluster.members {
        let metrics = scrape(&member.api);
        let leads = metrics["delayd_cluster_leader"];
        assert_eq!(leads, if member.id == leader { 1.0 } else { 0.0 });
        forwarded += metrics
            .get("delayd_cluster_forwarded_requests_total")
            .copied()
            .unwrap_or(0.0);
    }
    assert!(
        forwarded >= 2.0,
        "two messages and more went through followers"
    );

    // A follower is a hot standby: once each has applied what the leader committed, and they are
    // stopped, every member's schedule segments and dispatch logs hold the same bytes.
    cluster.caught_up();
    let mut cluster = cluster;
    for id in 1..=3 {
        let status = cluster.member(id).process.as_mut().unwrap().terminate();
        assert!(status.success(), "member {id} stopped with {status}");
    }
    cluster.same_files(&[1, 2, 3]);
}

/// Writers sending batches to every member while the leader is killed (SIGKILL) five times and
/// restarted, and once paused (SIGSTOP) past the election timeout: every acknowledged message is
/// delivered, none early; duplicates are counted (only deliveries in flight at a kill may repeat).
#[test]
fn leader_kills_and_a_pause_lose_nothing_acknowledged() {
    let mut cluster = Cluster::start(3);
    let apis: Vec<String> = cluster.members.iter().map(|m| m.api.clone()).collect();
    let writers = Writers::start(apis, 2, 0);
    let last_ack = writers.last_ack.clone();
    wait_for("the first acknowledgements", READY, || {
        last_ack.load(Ordering::SeqCst) > 0
    });
    let mut failovers = Vec::new();
    // Five kills and a pause by default; more for the failover figure in docs/benchmarks.md.
    let kills = common::env_number("DELAYD_CLUSTER_KILLS", 5);
    for round in 0..=kills {
        let leader = cluster.leader();
        let pause = round == 3;
        let killed_at = now_ms();
        println!("round {round}: stopping the leader, member {leader}, at {killed_at}");
        let pid = cluster.member(leader).process.as_ref().unwrap().pid();
        if pause {
            signal("STOP", pid);
        } else {
            cluster.member(leader).process.as_mut().unwrap().kill();
            cluster.member(leader).process = None;
        }
        wait_for("a write acknowledged after the failover", READY, || {
            last_ack.load(Ordering::SeqCst) > killed_at + 100
        });
        // The first acknowledgement after the kill: writers may still have had one in flight on a
        // follower, so the figure is the failover as a client sees it.
        let failover = last_ack.load(Ordering::SeqCst) - killed_at;
        match pause {
            true => println!("round {round}: paused leader, next ack after {failover} ms"),
            false => failovers.push(failover),
        }
        if pause {
            // Paused until another member led and took a write: past the election timeout.
            signal("CONT", pid);
        } else {
            cluster.launch(leader);
            cluster
                .member(leader)
                .process
                .as_mut()
                .unwrap()
                .wait_ready_within(READY);
        }
        // The next stop finds a healthy cluster: every member has what the leader had committed
        // (a member still catching up campaigns with a shorter log and loses, which openraft 0.9
        // answers with a longer wait: a failover of its own kind, not this one).
        cluster.caught_up();
    }
    let acknowledged = writers.stop();
    cluster.delivered_all(&acknowledged);
    let hits = cluster.receiver.hits();
    let mut times: BTreeMap<&str, u32> = BTreeMap::new();
    for hit in &hits {
        *times.entry(hit.body.as_str()).or_default() += 1;
    }
    let duplicates: u32 = times.values().map(|t| t - 1).sum();
    // Where the duplicates come from: the members of the two deliveries, and when the second came.
    let mut pairs: BTreeMap<(u64, u64, i64), u32> = BTreeMap::new();
    let mut first: BTreeMap<&str, &Hit> = BTreeMap::new();
    for hit in &hits {
        match first.get(hit.body.as_str()) {
            Some(earlier) => {
                *pairs
                    .entry((earlier.member, hit.member, hit.at_ms / 1000 % 1000))
                    .or_default() += 1
            }
            None => {
                first.insert(hit.body.as_str(), hit);
            }
        }
    }
    println!("duplicates by (first member, second member, second's second): {pairs:?}");
    failovers.sort();
    let percentile = |p: usize| failovers[(failovers.len() * p / 100).min(failovers.len() - 1)];
    println!(
        "acknowledged {} messages, delivered {} times ({} duplicates); failovers (kill → next ack) over {} kills: median {} ms, p99 {} ms, all {:?}",
        acknowledged.len(),
        hits.len(),
        duplicates,
        failovers.len(),
        percentile(50),
        percentile(99),
        failovers
    );
    // Only what was in flight at a kill (or the pause) repeats: what the lane had handed to the
    // receiver and not yet recorded.
    assert!(
        u64::from(duplicates) <= (kills + 1) * IN_FLIGHT * BATCH,
        "{duplicates} duplicates is more than was in flight"
    );
}

fn signal(name: &str, pid: u32) {
    let sent = std::process::Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(sent.success(), "kill -{name} {pid}");
}

/// The leader cut off from the others (its peer links through the test's proxies): it stops
/// acknowledging and, within its lease, delivering; the other two elect a leader that takes writes and
/// delivers; no message is delivered by both, and what the isolated one took but could not commit never
/// takes effect after the partition heals.
#[test]
fn an_isolated_leader_stops_and_the_majority_goes_on() {
    let cluster = Cluster::start(3);
    let old = cluster.leader();
    let api = |id: u64| cluster.members[(id - 1) as usize].api.clone();
    let post = |id: u64, n: u64, due: i64| {
        let body = message(n, due).to_string();
        request(&api(id), "POST", "/v1/messages", Some(&body), None)
    };
    // Due during and after the partition: whoever delivers them must be a leader with a lease.
    let start = now_ms();
    for n in 0..20 {
        let answer = post(old, n, start + 500 + n as i64 * 250);
        assert!((200..300).contains(&answer.status), "{answer:?}");
    }
    wait_for("the first deliveries", READY, || {
        !cluster.receiver.hits().is_empty()
    });
    let cut_at = now_ms();
    cluster.isolate(old);
    // Once the old leader has not heard from the others for an election timeout, its links are cut.
    wait_for("the old leader finds the others unreachable", READY, || {
        let seen = cluster_status(&api(old));
        (seen["members"].as_array().into_iter().flatten())
            .filter(|m| m["id"].as_u64() != Some(old))
            .all(|m| m["state"] == "unreachable")
    });
    // A write to the isolated leader is not acknowledged: its fate is uncertain, or it is refused.
    let refused = post(old, 100, now_ms() + 3_000);
    assert_eq!(refused.status, 503, "{refused:?}");
    let code = refused.json["code"].as_str().unwrap().to_string();
    assert!(
        code == "write_uncertain" || code == "no_leader",
        "{refused:?}"
    );
    // The other two elect one of them, which takes writes.
    let others: Vec<u64> = (1..=3).filter(|id| *id != old).collect();
    let mut new = 0;
    wait_for("the majority elects a leader", READY, || {
        let named: BTreeSet<Option<u64>> = (others.iter())
            .map(|id| cluster_status(&api(*id))["leader_id"].as_u64())
            .collect();
        match named.into_iter().collect::<Vec<_>>()[..] {
            [Some(id)] if id != old => {
                new = id;
                true
            }
            _ => false,
        }
    });
    wait_for("a write through the new leader", READY, || {
        (200..300).contains(&post(new, 200, now_ms() + 500).status)
    });
    wait_for("all twenty and the new one delivered", READY, || {
        let bodies: BTreeSet<String> = (cluster.receiver.hits().into_iter())
            .map(|h| h.body)
            .collect();
        (0..20).all(|n| bodies.iter().any(|b| b.starts_with(&format!("m{n}@"))))
            && bodies.iter().any(|b| b.starts_with("m200@"))
    });
    // The isolated leader's lease ended half an election timeout after the last heartbeat a majority
    // answered, before the cut: nothing it delivered came later than that (plus a call in flight).
    let hits = cluster.receiver.hits();
    let first_by_new = hits
        .iter()
        .filter(|h| h.member == new)
        .map(|h| h.at_ms)
        .min()
        .unwrap();
    for hit in hits.iter().filter(|h| h.member == old) {
        assert!(
            hit.at_ms < cut_at + 1_500 && hit.at_ms < first_by_new,
            "the isolated leader delivered {hit:?} after it was cut off at {cut_at}, or while member {new} led (from {first_by_new})"
        );
    }
    let mut times: BTreeMap<&str, u32> = BTreeMap::new();
    for hit in &hits {
        *times.entry(hit.body.as_str()).or_default() += 1;
    }
    println!(
        "partition: {} deliveries, {} bodies delivered twice",
        hits.len(),
        times.values().filter(|t| **t > 1).count()
    );

    // Healed, the old leader follows: its uncommitted write is cut from its log and never delivered.
    cluster.heal();
    wait_for("the old leader follows the new one", READY, || {
        cluster_status(&api(old))["leader_id"].as_u64() == Some(new)
    });
    let sentinel_due = now_ms() + 4_000;
    wait_for("a sentinel through the old leader", READY, || {
        (200..300).contains(&post(old, 300, sentinel_due).status)
    });
    wait_for("the sentinel delivered", READY, || {
        (cluster.receiver.hits().iter()).any(|h| h.body.starts_with("m300@"))
    });
    assert!(
        !(cluster.receiver.hits().iter()).any(|h| h.body.starts_with("m100@")),
        "the write the isolated leader could not commit took effect"
    );
}

/// A message for the built-in broker: one key, so every one of them goes to the same queue.
fn for_the_broker(n: u64, due_ms: i64) -> Value {
    json!({"topic": "tasks", "sink": "broker", "key": "one queue", "deliver_at": rfc3339(due_ms),
        "body": format!("t{n}")})
}

/// Pulls `tasks` from `offset` through the member at `base`, retrying while no leader answers: the
/// bodies, in order, and the offset to read next.
fn pull_tasks(base: &str, queue: u64, offset: u64) -> (Vec<String>, u64) {
    let path = format!("/v1/topics/tasks/queues/{queue}/messages?offset={offset}&max=100");
    let mut pulled = (Vec::new(), offset);
    wait_for("a pull answered", READY, || {
        let answer = request(base, "GET", &path, None, None);
        if answer.status != 200 {
            return false;
        }
        let bodies = (answer.json["messages"].as_array().unwrap().iter())
            .map(|m| m["body"].as_str().unwrap().to_string())
            .collect();
        pulled = (bodies, answer.json["next_offset"].as_u64().unwrap());
        true
    });
    pulled
}

/// The built-in broker through Raft (DESIGN.md §10): messages the leader delivers to the `broker`
/// sink and a consumer group's offset committed through a follower (forwarded to the leader) are
/// entries; after the leader is killed, pulls through any member (answered by the new leader) return
/// every message from the committed offset on, none missing, and the offset is still there.
#[test]
fn broker_messages_and_group_offsets_survive_a_leader_kill() {
    let mut cluster = Cluster::start(3);
    let leader = cluster.leader();
    let follower = cluster
        .running()
        .into_iter()
        .find(|&id| id != leader)
        .unwrap();
    let follower_api = cluster.member(follower).api.clone();
    let due = now_ms() + 300;
    let batch: Vec<Value> = (0..20).map(|n| for_the_broker(n, due)).collect();
    let body = json!({ "messages": batch }).to_string();
    let answer = request(
        &follower_api,
        "POST",
        "/v1/messages/batch",
        Some(&body),
        None,
    );
    assert!((200..300).contains(&answer.status), "{answer:?}");
    let mut queue = 0;
    wait_for("the 20 messages in the broker", READY, || {
        let topic = request(&follower_api, "GET", "/v1/topics/tasks", None, None);
        if topic.status != 200 {
            return false;
        }
        let queues = topic.json["queues"].as_array().unwrap();
        match queues.iter().find(|q| q["max_offset"].as_u64() == Some(20)) {
            Some(q) => {
                queue = q["queue"].as_u64().unwrap();
                true
            }
            None => false,
        }
    });
    let (first, next) = pull_tasks(&follower_api, queue, 0);
    let expected: Vec<String> = (0..20).map(|n| format!("t{n}")).collect();
    let mut sorted = first.clone();
    sorted.sort_by_key(|b| b[1..].parse::<u64>().unwrap());
    assert_eq!(sorted, expected, "each once");
    assert_eq!(next, 20);
    // The group read 8 of them, and commits that through the follower.
    let commit = json!({ "offset": 8 }).to_string();
    let path = format!("/v1/groups/readers/offsets/tasks/{queue}");
    wait_for("the offset committed", READY, || {
        let answer = request(&follower_api, "PUT", &path, Some(&commit), None);
        assert!(matches!(answer.status, 200 | 503), "{answer:?}");
        answer.status == 200
    });

    cluster.member(leader).process.as_mut().unwrap().kill();
    cluster.member(leader).process = None;
    let new_leader = cluster.leader();
    assert_ne!(new_leader, leader);
    for id in cluster.running() {
        let api = cluster.member(id).api.clone();
        // Answered once the new leader has loaded its wheel (503 no_leader until then).
        let mut offsets = request(&api, "GET", "/v1/groups/readers/offsets/tasks", None, None);
        wait_for("the group's offsets answered", READY, || {
            offsets = request(&api, "GET", "/v1/groups/readers/offsets/tasks", None, None);
            offsets.status != 503
        });
        assert_eq!(offsets.status, 200, "{offsets:?}");
        assert_eq!(
            offsets.json["queues"],
            json!([{"queue": queue, "offset": 8}]),
            "member {id}: {offsets:?}"
        );
        let (rest, next) = pull_tasks(&api, queue, 8);
        assert_eq!(
            rest,
            first[8..],
            "member {id}: the unread messages, none missing"
        );
        assert_eq!(next, 20);
    }
    // The new leader delivers to the broker at the next offsets.
    let more = json!({ "messages": [for_the_broker(20, now_ms())] }).to_string();
    let api = cluster.member(new_leader).api.clone();
    wait_for("the next message taken", READY, || {
        let answer = request(&api, "POST", "/v1/messages/batch", Some(&more), None);
        assert!(matches!(answer.status, 200..300 | 503), "{answer:?}");
        answer.status != 503
    });
    wait_for("the next message at offset 20", READY, || {
        pull_tasks(&follower_api, queue, 20).0 == ["t20"]
    });
}

/// How many times each body is stored in the broker topic `orders`, read through the member at `base`
/// (retrying while no leader answers).
fn broker_bodies(base: &str) -> BTreeMap<String, u32> {
    let mut bodies = BTreeMap::new();
    for m in common::topic_messages(base, "orders") {
        *bodies
            .entry(m["body"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    bodies
}

/// Writers sending messages for the built-in broker while the leader is killed (SIGKILL) and
/// restarted, `DELAYD_CLUSTER_KILLS` (3) times: a delivery's broker append and its outcome are one
/// Raft entry (broker/outcomes.rs), so no failover separates them, and every acknowledged message is
/// stored exactly once, none early.
#[test]
fn deliveries_into_the_broker_are_stored_once_across_leader_kills() {
    let mut cluster = Cluster::start(3);
    let apis: Vec<String> = cluster.members.iter().map(|m| m.api.clone()).collect();
    let writers = Writers::start_to(apis, 2, 0, "broker");
    let last_ack = writers.last_ack.clone();
    wait_for("the first acknowledgements", READY, || {
        last_ack.load(Ordering::SeqCst) > 0
    });
    let kills = common::env_number("DELAYD_CLUSTER_KILLS", 3);
    for round in 0..kills {
        let leader = cluster.leader();
        let killed_at = now_ms();
        println!("round {round}: killing the leader, member {leader}");
        cluster.member(leader).process.as_mut().unwrap().kill();
        cluster.member(leader).process = None;
        wait_for("a write acknowledged after the failover", READY, || {
            last_ack.load(Ordering::SeqCst) > killed_at + 100
        });
        cluster.launch(leader);
        (cluster.member(leader).process.as_mut().unwrap()).wait_ready_within(READY);
        cluster.caught_up();
    }
    let acknowledged = writers.stop();
    let latest_due = acknowledged.values().copied().max().unwrap();
    let api = cluster.member(cluster.leader()).api.clone();
    let mut stored = BTreeMap::new();
    wait_for(
        "every acknowledged message stored",
        Duration::from_secs(90),
        || {
            stored = broker_bodies(&api);
            now_ms() > latest_due && acknowledged.keys().all(|b| stored.contains_key(b))
        },
    );
    let twice: Vec<_> = stored.iter().filter(|(_, n)| **n > 1).collect();
    println!(
        "{kills} leader kills: {} acknowledged, {} stored, {} more than once",
        acknowledged.len(),
        stored.len(),
        twice.len()
    );
    assert!(twice.is_empty(), "stored more than once: {twice:?}");
}

/// A member's `sources/{name}`: its source's mark, if it has one.
fn mark_of(cluster: &Cluster, id: u64) -> Option<Vec<u8>> {
    let data = cluster.members[(id - 1) as usize].dir.path().join("data");
    std::fs::read(data.join("sources").join("in")).ok()
}

/// The positions a mark lists as written and not acknowledged to the MQ.
fn unacked_in(mark: &[u8]) -> usize {
    let mark: Value = serde_json::from_slice(mark).unwrap();
    mark["unacked"].as_array().unwrap().len()
}

/// Waits until every running member's mark holds the same bytes, listing `unacked` positions.
fn marks_alike(cluster: &Cluster, unacked: usize) -> Vec<u8> {
    let mut alike = Vec::new();
    let what = format!("every member's mark alike, listing {unacked} unacknowledged requests");
    wait_for(&what, READY, || {
        let marks: BTreeSet<Option<Vec<u8>>> = (cluster.running().into_iter())
            .map(|id| mark_of(cluster, id))
            .collect();
        match marks.into_iter().collect::<Vec<_>>().as_slice() {
            [Some(mark)] if unacked_in(mark) == unacked => {
                alike = mark.clone();
                true
            }
            _ => false,
        }
    });
    alike
}

/// A Redis Streams source on the cluster (DESIGN.md §10, §11): its mark is an entry, so every member's
/// `sources/in` holds the same bytes, and a new leader starts the source from the old leader's mark.
/// Redis refuses `XACK` at first, so the requests the leader scheduled stay unacknowledged, listed in
/// its mark; the leader is killed, and Redis (restarted with `XACK`) delivers them again to the new
/// leader, which recognises every one: none is scheduled twice, each request has one `webhook-id`.
#[test]
fn a_sources_mark_is_on_every_member_and_a_new_leader_schedules_nothing_twice() {
    const REQUESTS: usize = 20;
    const AFTER: usize = 5;
    if !common::server_installed("redis-server", "apt-get install -y redis-server") {
        return;
    }
    // On a member's kind of port: Redis binds it again when it restarts.
    let redis_dir = tempfile::tempdir().unwrap();
    let no_acks = ["--rename-command", "XACK", ""];
    let mut redis = RedisServer::start_on(member_port(), redis_dir.path(), &no_acks);
    for n in 0..REQUESTS {
        let fields = [("delayd-delay", "1s"), ("delayd-target", "orders")];
        redis.publish(&fields, &format!("r{n}"));
    }
    // One consumer name on every member: only the leader runs the source, and a new leader must be
    // handed what the old one read and did not acknowledge (Redis keeps that per consumer).
    let source = format!(
        "[sources.in]\nkind = \"redis\"\nurl = \"{}\"\nstream_key = \"delayd:in\"\nconsumer = \"delayd\"\nsink = \"hook\"\n",
        redis.url()
    );
    let mut cluster = Cluster::start_with(3, &source);
    let before = marks_alike(&cluster, REQUESTS);
    let old = cluster.leader();
    println!(
        "member {old} leads; the mark on every member: {}",
        String::from_utf8_lossy(&before)
    );

    cluster.member(old).process.as_mut().unwrap().kill();
    cluster.member(old).process = None;
    redis.restart_with(&[]);
    let new = cluster.leader();
    assert_ne!(new, old);
    let api = cluster.member(new).api.clone();
    let taken = |outcome| source_count(&api, outcome);
    wait_for(
        "the new leader's source took the requests again, and Redis has them acknowledged",
        READY,
        || taken("duplicate") + taken("scheduled") >= REQUESTS as f64 && redis.pending() == 0,
    );
    assert_eq!(
        (taken("scheduled"), taken("duplicate") >= REQUESTS as f64),
        (0.0, true),
        "the new leader scheduled requests the old one had"
    );
    let log = cluster
        .member(new)
        .process
        .as_ref()
        .unwrap()
        .stdout_so_far();
    assert!(
        log.contains(&format!(
            "they will not be scheduled twice source=in records={REQUESTS}"
        )),
        "the new leader started the source from the old leader's mark:\n{log}"
    );
    // New requests are scheduled as usual.
    for n in REQUESTS..REQUESTS + AFTER {
        let fields = [("delayd-delay", "1s"), ("delayd-target", "orders")];
        redis.publish(&fields, &format!("r{n}"));
    }
    wait_for("the new requests scheduled", READY, || {
        taken("scheduled") == AFTER as f64 && redis.pending() == 0
    });
    wait_for("every request delivered", READY, || {
        let bodies: BTreeSet<String> = (cluster.receiver.hits().into_iter())
            .map(|h| h.body)
            .collect();
        (0..REQUESTS + AFTER).all(|n| bodies.contains(&format!("r{n}")))
    });
    // Each request was one message: one id, however often it was delivered.
    let mut ids: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for hit in cluster.receiver.hits() {
        ids.entry(hit.body).or_default().insert(hit.id);
    }
    for (body, ids) in &ids {
        assert_eq!(ids.len(), 1, "{body} was scheduled as {ids:?}");
    }
    assert_eq!(taken("scheduled"), AFTER as f64);

    // The old leader comes back and catches up: every member's mark is the new leader's, with
    // nothing unacknowledged.
    cluster.launch(old);
    cluster
        .member(old)
        .process
        .as_mut()
        .unwrap()
        .wait_ready_within(READY);
    cluster.caught_up();
    marks_alike(&cluster, 0);
}

/// A member whose disk is lost for good (issue 34): killed under load, its data dir deleted, and
/// restarted empty with the same id after the others purged their logs far past what it had. It
/// catches up by a snapshot (streamed over the peer link, swapped in at a restart of its own) and
/// the log after it. Then the leader is killed: nothing acknowledged is lost, and the two members
/// left hold the same files. Every member took several snapshots and kept at most two, and its WAL
/// was purged from the front.
#[test]
fn a_member_restarted_empty_catches_up_by_snapshot_and_nothing_acknowledged_is_lost() {
    let keys = "snapshot_entries = 100\nlog_file_bytes = 65536";
    let mut cluster = Cluster::start_configured(3, "", keys);
    let apis: Vec<String> = cluster.members.iter().map(|m| m.api.clone()).collect();
    let writers = Writers::start(apis, 2, 1000);
    let last_ack = writers.last_ack.clone();
    wait_for("the first acknowledgements", READY, || {
        last_ack.load(Ordering::SeqCst) > 0
    });
    let leader = cluster.leader();
    let lost = (1..=3).find(|&id| id != leader).unwrap();
    // A recurring schedule (daily: no firing during the test): a snapshot carries the schedule table
    // (`schedules/`) too.
    let leader_api = cluster.member(leader).api.clone();
    let body = json!({"cron": "0 9 * * *", "topic": "reports", "body": "r"});
    let put = request(
        &leader_api,
        "PUT",
        "/v1/schedules/daily",
        Some(&body.to_string()),
        None,
    );
    assert_eq!(put.status, 201, "{}", put.json);
    cluster.member(lost).process.as_mut().unwrap().kill();
    cluster.member(lost).process = None;
    std::fs::remove_dir_all(cluster.member(lost).dir.path().join("data")).unwrap();
    // Enough entries meanwhile that the others purged their logs past the start: a snapshot every
    // 100 entries, and 100 kept behind the newest.
    let commit_index = |api: &str| cluster_status(api)["commit_index"].as_u64().unwrap_or(0);
    let from = commit_index(&leader_api);
    // Long enough too for the WAL's bound to show: it keeps 100 to 200 entries, whatever went by, so
    // it is no bigger after 1,000 entries than after 500.
    let wal_bytes = |cluster: &Cluster, id: u64| -> u64 {
        let wal = cluster.members[(id - 1) as usize]
            .dir
            .path()
            .join("data/wal");
        (std::fs::read_dir(wal).unwrap())
            .map(|e| e.unwrap().metadata().map_or(0, |m| m.len()))
            .sum()
    };
    let others: Vec<u64> = (1..=3).filter(|&id| id != lost).collect();
    wait_for("500 entries more", Duration::from_secs(180), || {
        commit_index(&leader_api) >= from + 500
    });
    let halfway: Vec<u64> = others.iter().map(|&id| wal_bytes(&cluster, id)).collect();
    wait_for("1,000 entries more", Duration::from_secs(180), || {
        commit_index(&leader_api) >= from + 1_000
    });
    for (&id, &before) in others.iter().zip(&halfway) {
        let after = wal_bytes(&cluster, id);
        println!("member {id}: WAL {before} bytes after 500 entries, {after} after 1,000");
        assert!(
            after < before * 3 / 2,
            "member {id}: the WAL grew from {before} to {after} bytes: not bounded"
        );
    }

    // Restarted as the runbook says: `join = true` (it founds nothing, and votes only once caught up).
    let config = cluster.member(lost).config.clone();
    let text = std::fs::read_to_string(&config).unwrap();
    let text = text.replace(
        "election_timeout = \"1s\"\n",
        "election_timeout = \"1s\"\njoin = true\n",
    );
    std::fs::write(&config, text).unwrap();
    let restarted = std::time::Instant::now();
    cluster.launch(lost);
    cluster
        .member(lost)
        .process
        .as_mut()
        .unwrap()
        .wait_ready_within(READY);
    cluster.caught_up();
    let lost_api = cluster.member(lost).api.clone();
    let installed = scrape(&lost_api)["delayd_cluster_snapshots_installed_total"];
    println!(
        "member {lost}, restarted empty, caught up in {} ms by {installed} snapshot(s)",
        restarted.elapsed().as_millis()
    );
    assert_eq!(installed, 1.0, "it caught up by one snapshot");
    // Its own table (the gauge counts what this member holds) has the schedule put before it died.
    wait_for("the restarted member holds the schedule", READY, || {
        scrape(&lost_api).get("delayd_schedules") == Some(&1.0)
    });

    for member in &cluster.members {
        let taken = scrape(&member.api)["delayd_cluster_snapshots_taken_total"];
        let raft = member.dir.path().join("data/raft");
        let kept: Vec<String> = std::fs::read_dir(raft.join("snapshots"))
            .map(|dir| {
                dir.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .filter(|name| !name.ends_with(".partial"))
                    .collect()
            })
            .unwrap_or_default();
        let wal: Vec<u64> = std::fs::read_dir(member.dir.path().join("data/wal"))
            .unwrap()
            .filter_map(|e| {
                let name = e.unwrap().file_name().to_string_lossy().into_owned();
                name.strip_suffix(".wal").and_then(|seq| seq.parse().ok())
            })
            .collect();
        let on_disk: u64 = std::fs::read_dir(member.dir.path().join("data/wal"))
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum();
        let written = scrape(&member.api)["delayd_wal_bytes_written_total"];
        println!(
            "member {}: {taken} snapshots taken, {} kept, {} WAL files ({on_disk} bytes, of {written} written) from seq {:?}",
            member.id,
            kept.len(),
            wal.len(),
            wal.iter().min()
        );
        // The newest; one a transfer still reads; one being replaced at that moment: no more.
        assert!(kept.len() <= 3, "member {}: {kept:?}", member.id);
        if member.id != lost {
            assert!(taken >= 3.0, "member {} took {taken} snapshots", member.id);
            assert!(
                wal.iter().min().is_some_and(|&first| first > 1),
                "member {}: its WAL was purged from the front: {wal:?}",
                member.id
            );
        }
    }

    cluster.member(leader).process.as_mut().unwrap().kill();
    cluster.member(leader).process = None;
    let killed_at = now_ms();
    let new_leader = cluster.leader();
    assert_ne!(new_leader, leader);
    cluster.finish(writers, killed_at);
}

/// `delayd cluster ARGS...` against the member at `api`: its output, once it exited 0.
fn cluster_cli(api: &str, args: &[&str]) -> String {
    let mut all = vec!["cluster"];
    all.extend_from_slice(args);
    let mut cli = common::spawn_cli(api, &all);
    let (lines, status) = cli.finish_before(std::time::Instant::now() + Duration::from_secs(120));
    assert!(
        status.is_some_and(|s| s.success()),
        "delayd {all:?} failed ({status:?}): {lines:?}"
    );
    lines.join("\n")
}

/// The voters the member at `api` knows.
fn voters(api: &str) -> BTreeSet<u64> {
    cluster_status(api)["members"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["voter"] == true)
        .map(|m| m["id"].as_u64().unwrap())
        .collect()
}

/// Membership (issue 34), under load: two members started with `join = true` are added with the
/// CLI through a follower (each a learner until caught up, then a voter: 3 → 5); then the leader is
/// removed (it steps down, another leads) and one more (5 → 3). Nothing acknowledged is lost, and
/// the three members left hold the same files.
#[test]
fn the_cluster_grows_to_five_and_shrinks_back_under_load_losing_nothing() {
    let mut cluster = Cluster::prepare(5, 3, "", "");
    for id in 1..=3 {
        cluster.launch(id);
    }
    for id in 1..=3 {
        let process = cluster.member(id).process.as_mut().unwrap();
        process.wait_ready_within(READY);
    }
    let apis: Vec<String> = (cluster.members.iter().take(3))
        .map(|m| m.api.clone())
        .collect();
    let writers = Writers::start(apis, 2, 0);
    let last_ack = writers.last_ack.clone();
    wait_for("the first acknowledgements", READY, || {
        last_ack.load(Ordering::SeqCst) > 0
    });

    for id in [4, 5] {
        // (Asked before it runs: a member not added yet knows no leader.)
        let leader = cluster.leader();
        cluster.launch(id);
        let follower = (1..=3).find(|&f| f != leader).unwrap();
        let via = cluster.member(follower).api.clone();
        let (api, peer) = {
            let added = &cluster.members[(id - 1) as usize];
            let peer = format!("127.0.0.1:{}", cluster.proxies[(id - 1) as usize].port);
            (added.api.clone(), peer)
        };
        let id_text = id.to_string();
        let shown = cluster_cli(
            &via,
            &["add", "--id", &id_text, "--api", &api, "--peer", &peer],
        );
        assert!(shown.contains(&api), "{shown}");
        let process = cluster.member(id).process.as_mut().unwrap();
        process.wait_ready_within(READY);
        let leader_api = cluster.member(cluster.leader()).api.clone();
        assert!(voters(&leader_api).contains(&id), "member {id} is a voter");
    }
    let leader_api = cluster.member(cluster.leader()).api.clone();
    assert_eq!(voters(&leader_api), BTreeSet::from([1, 2, 3, 4, 5]));
    cluster.caught_up();

    // Shrink: the leader first (asked through another member), then member 4.
    let leader = cluster.leader();
    let via = cluster.member(if leader == 5 { 1 } else { 5 }).api.clone();
    cluster_cli(&via, &["remove", &leader.to_string()]);
    let status = cluster.member(leader).process.as_mut().unwrap().terminate();
    assert!(
        status.success(),
        "the removed leader stopped cleanly: {status}"
    );
    cluster.member(leader).process = None;
    let next = cluster.leader();
    assert_ne!(next, leader);
    let removed = if leader == 4 { 5 } else { 4 };
    cluster_cli(
        &cluster.member(next).api.clone(),
        &["remove", &removed.to_string()],
    );
    let status = cluster
        .member(removed)
        .process
        .as_mut()
        .unwrap()
        .terminate();
    assert!(
        status.success(),
        "member {removed} stopped cleanly: {status}"
    );
    cluster.member(removed).process = None;
    let left = cluster.running();
    let next_api = cluster.member(cluster.leader()).api.clone();
    assert_eq!(
        voters(&next_api),
        left.iter().copied().collect::<BTreeSet<u64>>()
    );

    // The last voters cannot go below one; a member that is none is not found.
    let removed_again = request(
        &next_api,
        "DELETE",
        &format!("/v1/cluster/members/{leader}"),
        None,
        None,
    );
    assert_eq!(removed_again.status, 404, "{removed_again:?}");

    cluster.finish(writers, now_ms());
}

/// Membership changes the cluster refuses, each saying why: the last voter, a member that is none,
/// a voter added again, a body that is no member, and a member that never answers (taken out again).
#[test]
fn membership_refusals_explain_themselves() {
    let mut cluster = Cluster::start(1);
    let api = cluster.member(1).api.clone();
    let refused = |method: &str, path: &str, body: Option<&str>, status: u16, code: &str| {
        let answer = request(&api, method, path, body, None);
        assert_eq!(answer.status, status, "{method} {path}: {answer:?}");
        assert_eq!(answer.json["code"], code, "{answer:?}");
        answer.json["detail"].as_str().unwrap().to_string()
    };
    let why = refused(
        "DELETE",
        "/v1/cluster/members/1",
        None,
        409,
        "membership_conflict",
    );
    assert!(why.contains("only voter"), "{why}");
    refused("DELETE", "/v1/cluster/members/9", None, 404, "not_found");
    refused(
        "DELETE",
        "/v1/cluster/members/x",
        None,
        400,
        "invalid_member",
    );
    let no_port = r#"{"id": 2, "api": "http://127.0.0.1:1", "peer": "127.0.0.1"}"#;
    let why = refused(
        "POST",
        "/v1/cluster/members",
        Some(no_port),
        400,
        "invalid_member",
    );
    assert!(why.starts_with("peer: "), "{why}");
    refused(
        "POST",
        "/v1/cluster/members",
        Some("{}"),
        400,
        "invalid_json",
    );
    let me = cluster_status(&api)["members"][0].clone();
    let again = json!({"id": 1, "api": me["api"], "peer": me["peer"]}).to_string();
    let why = refused(
        "POST",
        "/v1/cluster/members",
        Some(&again),
        409,
        "membership_conflict",
    );
    assert!(why.contains("a voter already"), "{why}");

    // Nothing listens where member 2 is said to be.
    let closed = member_port();
    let nobody =
        json!({"id": 2, "api": "http://127.0.0.1:1", "peer": format!("127.0.0.1:{closed}")});
    let why = refused(
        "POST",
        "/v1/cluster/members",
        Some(&nobody.to_string()),
        422,
        "member_unreachable",
    );
    assert!(
        why.contains("did not answer") && why.contains("was not added"),
        "{why}"
    );
    assert_eq!(voters(&api), BTreeSet::from([1]));
    let members = cluster_status(&api)["members"].as_array().unwrap().len();
    assert_eq!(members, 1, "member 2 was taken out again");
    let shown = cluster_cli(&api, &["status"]);
    assert!(
        shown.contains("leader 1") && !shown.contains(&closed.to_string()),
        "{shown}"
    );
}

/// Recurring schedules through failovers (DESIGN §14): a schedule and its progress are entries, so
/// the leader after a kill plans from exactly where the last one's firings were committed. Across
/// three leader kills, every fire time is one message (delivered at least once, by whichever member
/// led): none twice; with `catchup: all` none missing either; none early.
#[test]
fn recurring_schedules_fire_once_per_fire_time_across_leader_kills() {
    let mut cluster = Cluster::start(3);
    let leader = cluster.leader();
    let follower = (cluster.running().into_iter())
        .find(|&id| id != leader)
        .unwrap();
    let api = cluster.member(follower).api.clone();
    for (id, timing) in [
        ("all", json!({"every": "1s", "catchup": "all"})),
        ("one", json!({"cron": "* * * * * *", "catchup": "one"})),
    ] {
        let mut body = timing;
        body["topic"] = json!("firings");
        body["body"] = json!(id);
        body["sink"] = json!("hook");
        // Through a follower: forwarded to the leader.
        let answer = request(
            &api,
            "PUT",
            &format!("/v1/schedules/{id}"),
            Some(&body.to_string()),
            None,
        );
        assert_eq!(answer.status, 201, "{}", answer.json);
    }
    // Written firings, as the leader counts them (through any member: forwarded), once one answers.
    let fired = |api: &str| -> u64 {
        let mut fired = 0;
        wait_for("a leader answered", READY, || {
            let answer = request(api, "GET", "/v1/schedules/all", None, None);
            fired = answer.json["fired"].as_u64().unwrap_or(0);
            answer.status == 200
        });
        fired
    };
    for round in 0..3 {
        let leader = cluster.leader();
        let other = (cluster.running().into_iter())
            .find(|&id| id != leader)
            .unwrap();
        let api = cluster.member(other).api.clone();
        let before = fired(&api);
        wait_for("the schedules fired again", READY, || {
            fired(&api) >= before + 2
        });
        println!("round {round}: killing the leader, member {leader}");
        cluster.member(leader).process.as_mut().unwrap().kill();
        cluster.member(leader).process = None;
        wait_for("firings after the failover", READY, || {
            fired(&api) >= before + 4
        });
        cluster.launch(leader);
        cluster
            .member(leader)
            .process
            .as_mut()
            .unwrap()
            .wait_ready_within(READY);
        cluster.caught_up();
    }
    let leader = cluster.leader();
    let api = cluster.member(leader).api.clone();
    // Enough firings of each before they stop (catch-up `one` folds what a failover missed).
    for id in ["all", "one"] {
        wait_for("15 firings written", READY, || {
            let answer = request(&api, "GET", &format!("/v1/schedules/{id}"), None, None);
            answer.json["fired"].as_u64().unwrap_or(0) >= 15
        });
    }
    for id in ["all", "one"] {
        let answer = request(
            &api,
            "POST",
            &format!("/v1/schedules/{id}/pause"),
            None,
            None,
        );
        assert_eq!(answer.status, 200, "{}", answer.json);
        let last = answer.json["last_message_id"].as_str().unwrap().to_string();
        wait_for("the last firing settled", READY, || {
            let status = common::settled_message(&api, &last).json["status"].clone();
            status == "delivered" || status == "cancelled"
        });
    }
    let mut by_time: BTreeMap<(String, i64), BTreeSet<String>> = BTreeMap::new();
    for hit in cluster.receiver.hits() {
        let fire_at = hit.fire_at.expect("a firing carries delayd-fire-at");
        assert!(hit.at_ms >= fire_at, "never early: {hit:?}");
        by_time
            .entry((hit.body.clone(), fire_at))
            .or_default()
            .insert(hit.id);
    }
    let twice: Vec<_> = by_time.iter().filter(|(_, ids)| ids.len() > 1).collect();
    assert!(twice.is_empty(), "fire times made twice: {twice:?}");
    for id in ["all", "one"] {
        let times: Vec<i64> = (by_time.keys())
            .filter(|(s, _)| s == id)
            .map(|(_, at)| *at)
            .collect();
        let answer = request(&api, "GET", &format!("/v1/schedules/{id}"), None, None);
        let written = answer.json["fired"].as_u64().unwrap();
        // The last may be withdrawn by the pause.
        let delivered = times.len() as u64;
        assert!(
            delivered <= written && delivered + 1 >= written,
            "{id}: {delivered} delivered of {written}"
        );
        assert!(written >= 15, "{id}: {written} written");
        for pair in times.windows(2) {
            let gap = pair[1] - pair[0];
            assert!(gap > 0 && gap % 1_000 == 0, "{id}: {pair:?} off its phase");
            if id == "all" {
                assert_eq!(gap, 1_000, "{id}: a fire time missing between {pair:?}");
            }
        }
        println!("{id}: {} fire times, each one message", times.len());
    }
}
