//! The operations kit (`deploy/`) against the real binary: every metric the Grafana dashboard and the
//! Prometheus alert rules name is in a live `/metrics` (a single node's, or the cluster members' for
//! the `delayd_cluster_*` ones, the members started from the cluster ConfigMap's file); systemd hears
//! `READY=1` and `STOPPING=1`; the container health check (`delayd probe`) tells a ready service from
//! an absent one; `--version`. The files themselves are checked by their own tools in
//! `deploy/check.sh`.

use crate::common::{
    free_port, request, scrape, spawn_member, spawn_with_env, wait_for, write_file, Process,
};
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::net::UnixDatagram;
use std::process::Command;
use std::time::Duration;

const DEPLOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy");

/// Every `delayd_*` name in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (at, _) in text.match_indices("delayd_") {
        if text[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            continue; // inside a longer word
        }
        let name: String = text[at..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        names.insert(name);
    }
    names
}

/// The `expr` of every query of a Grafana dashboard, wherever it sits (panels, rows, variables).
/// Fails naming each metric of `named` that no series of `exported` (`name{labels}` keys) has.
fn assert_exported<'a>(
    named: &BTreeSet<String>,
    exported: impl Iterator<Item = &'a String>,
    by: &str,
) {
    let exported: BTreeSet<&str> = exported
        .map(|series| series.split('{').next().unwrap())
        .collect();
    let missing: Vec<&String> = named
        .iter()
        .filter(|name| !exported.contains(name.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "named by deploy/ but not exported by {by}: {missing:?}\nexported: {exported:?}"
    );
}

fn dashboard_queries(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("expr" | "query", serde_json::Value::String(query)) => out.push(query.clone()),
                    _ => dashboard_queries(value, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| dashboard_queries(v, out)),
        _ => {}
    }
}

/// Every `delayd_*` name the dashboard's queries and the alert rules use.
fn named_by_deploy() -> BTreeSet<String> {
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{DEPLOY}/grafana/delayd.json")).unwrap(),
    )
    .unwrap();
    let mut queries = Vec::new();
    dashboard_queries(&dashboard, &mut queries);
    assert!(queries.len() >= 20, "{queries:?}");
    let mut named = metric_names(&queries.join("\n"));
    let alerts = std::fs::read_to_string(format!("{DEPLOY}/prometheus/alerts.yml")).unwrap();
    named.extend(metric_names(&alerts));
    assert!(named.len() >= 25, "{named:?}");
    named
}

/// Only cluster members export these (checked by the cluster test below).
const CLUSTER_METRICS: &str = "delayd_cluster_";

/// A dashboard or an alert that names a metric the service does not export shows nothing, or never
/// fires. With a source and an MQ sink configured (their servers absent: the series exist anyway) and
/// one message delivered (the WAL, the broker and the HTTP histograms have observations), every name
/// the dashboard's queries and the alert rules use is a series of the live `/metrics`, but for the
/// cluster's, which a single node does not export.
#[test]
fn every_metric_the_dashboard_and_the_alerts_name_is_exported() {
    let (cluster, named): (BTreeSet<String>, BTreeSet<String>) = named_by_deploy()
        .into_iter()
        .partition(|name| name.starts_with(CLUSTER_METRICS));
    assert!(cluster.len() >= 5, "{cluster:?}");

    let dir = tempfile::tempdir().unwrap();
    let nothing = format!("redis://127.0.0.1:{}/", free_port());
    let text = format!(
        "[sinks.out]\nkind = \"redis\"\nurl = \"{nothing}\"\n\n\
         [sources.in]\nkind = \"redis\"\nurl = \"{nothing}\"\nstream_key = \"in\"\nconsumer = \"node-a\"\nsink = \"out\"\n"
    );
    let config = write_file(dir.path(), "delayd.toml", &text);
    let process = spawn_with_env(
        &dir.path().join("data"),
        &["--config", config.to_str().unwrap()],
        &[("DELAYD_MIN_FREE_DISK_BYTES", "0")],
    );
    let sent = request(
        &process.base,
        "POST",
        "/v1/messages",
        Some(r#"{"topic": "deploy", "body": "x", "delay": 0}"#),
        None,
    );
    assert_eq!(sent.status, 201, "{}", sent.json);
    let delivered = r#"delayd_messages_delivered_total{sink="broker",outcome="ok"}"#;
    wait_for("the message's delivery", Duration::from_secs(30), || {
        scrape(&process.base).get(delivered) == Some(&1.0)
    });
    let series = scrape(&process.base);
    assert_exported(&named, series.keys(), "a single node");
    let version = format!(
        r#"delayd_build_info{{version="{}"}}"#,
        env!("CARGO_PKG_VERSION")
    );
    assert_eq!(series.get(&version), Some(&1.0), "{series:#?}");
}

/// `delayd serve` started without waiting for it; killed on drop, pass or fail.
struct Unwaited(std::process::Child);

impl Drop for Unwaited {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Under systemd (`Type=notify`), `READY=1` comes only once recovery is done (here a WAL of a killed
/// node to replay): `/readyz` answers 200 at the moment it arrives. `STOPPING=1` comes when a SIGTERM
/// starts the graceful stop, before a clean exit.
#[test]
fn systemd_hears_ready_after_recovery_and_stopping_at_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut first = spawn_with_env(&data, &[], &[("DELAYD_MIN_FREE_DISK_BYTES", "0")]);
    for batch in 0..5 {
        let messages: Vec<serde_json::Value> = (0..2_000)
            .map(|i| serde_json::json!({"topic": "later", "body": format!("m{batch}-{i}"), "delay": "1h"}))
            .collect();
        let body = serde_json::json!({ "messages": messages }).to_string();
        let sent = request(&first.base, "POST", "/v1/messages/batch", Some(&body), None);
        assert_eq!(sent.status, 200, "{}", sent.json);
    }
    first.kill(); // right after the acks: the restart replays what the last checkpoint (every 2 s) missed

    let socket_path = dir.path().join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let base = format!("http://127.0.0.1:{}", free_port());
    let stdout = dir.path().join("stdout.log");
    let mut process = Unwaited(
        Command::new(env!("CARGO_BIN_EXE_delayd"))
            .args(["serve", "--listen", &base["http://".len()..], "--data-dir"])
            .arg(&data)
            .env_clear()
            .env("DELAYD_MIN_FREE_DISK_BYTES", "0")
            .env("NOTIFY_SOCKET", &socket_path)
            .stdout(std::fs::File::create(&stdout).unwrap())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut buffer = [0u8; 256];
    let n = socket.recv(&mut buffer).expect("READY=1 within 60 s");
    assert_eq!(std::str::from_utf8(&buffer[..n]).unwrap(), "READY=1");
    // Sent after the replay: the "ready" line, printed once recovery is done, is already out.
    let printed = std::fs::read_to_string(&stdout).unwrap();
    assert!(printed.contains("delayd ready on"), "{printed}");
    let ready = request(&base, "GET", "/readyz", None, None);
    assert_eq!(ready.status, 200, "ready when READY=1 came: {}", ready.json);
    let pending = scrape(&base)["delayd_pending_messages"];
    println!("READY=1 with /readyz 200 and {pending} messages pending after the replay");

    let pid = process.0.id().to_string();
    let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(sent.success());
    let n = socket.recv(&mut buffer).expect("STOPPING=1 within 60 s");
    assert_eq!(std::str::from_utf8(&buffer[..n]).unwrap(), "STOPPING=1");
    let status = process.0.wait().unwrap();
    assert!(status.success(), "pid {pid} stopped cleanly: {status}");
}

fn probe(args: &[&str], listen: Option<&str>) -> (bool, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_delayd"));
    command
        .arg("probe")
        .args(args)
        .env_remove("DELAYD_LISTEN")
        .env_remove("DELAYD_URL");
    if let Some(listen) = listen {
        command.env("DELAYD_LISTEN", listen);
    }
    let output = command.output().unwrap();
    (
        output.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
    )
}

/// The container health check: `delayd probe` succeeds against a ready service, found from
/// `DELAYD_LISTEN` as the container sets it (a wildcard address probed on loopback), from `--listen`
/// or from the service's URL (`--url` or `DELAYD_URL`, as for `send`), and fails, saying why, where
/// nothing listens.
#[test]
fn the_probe_tells_a_ready_service_from_an_absent_one() {
    let dir = tempfile::tempdir().unwrap();
    let process = spawn_with_env(dir.path(), &[], &[("DELAYD_MIN_FREE_DISK_BYTES", "0")]);
    let port = process.base.rsplit(':').next().unwrap().to_string();
    let (ok, said) = probe(&[], Some(&format!("0.0.0.0:{port}")));
    assert!(ok, "{said}");
    let (ok, said) = probe(&["--listen", &format!("127.0.0.1:{port}")], None);
    assert!(ok, "{said}");
    let (ok, said) = probe(&["--url", &format!("{}/readyz", process.base)], None);
    assert!(ok, "{said}");
    // As `send` and `tail` take it: the service's URL, from the flag or DELAYD_URL.
    let (ok, said) = probe(&["--url", &format!("{}/", process.base)], None);
    assert!(ok, "{said}");
    let output = Command::new(env!("CARGO_BIN_EXE_delayd"))
        .arg("probe")
        .env_remove("DELAYD_LISTEN")
        .env("DELAYD_URL", &process.base)
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    assert!(String::from_utf8_lossy(&output.stdout).contains("ready"));
    let (ok, said) = probe(&["--url", "not a url"], None);
    assert!(!ok && said.contains("not a URL"), "{said}");
    drop(process);
    let (ok, said) = probe(&["--listen", &format!("127.0.0.1:{port}")], None);
    assert!(!ok, "nothing listens on {port} any more: {said}");
    assert!(said.contains("/readyz"), "{said}");
    let (ok, said) = probe(&["--listen", "not-an-address"], None);
    assert!(!ok && said.contains("not-an-address"), "{said}");

    // A node that answers, but not ready (a failed WAL fsync: 503 storage_failed), is unhealthy.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/readyz", listener.local_addr().unwrap());
    let server = std::thread::spawn(move || {
        use std::io::{BufRead, Write};
        let (stream, _) = listener.accept().unwrap();
        let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
        let mut line = String::new();
        while reader.read_line(&mut line).unwrap() > 0 && line != "\r\n" {
            line.clear();
        }
        let body = r#"{"code":"storage_failed"}"#;
        write!(
            &stream,
            "HTTP/1.1 503 Service Unavailable\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
    });
    let (ok, said) = probe(&["--url", &url], None);
    server.join().unwrap();
    assert!(!ok, "{said}");
    assert!(
        said.contains("503") && said.contains("storage_failed"),
        "{said}"
    );
}

#[test]
fn version_is_the_crates() {
    let output = Command::new(env!("CARGO_BIN_EXE_delayd"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(output.status.success());
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        format!("delayd {}", env!("CARGO_PKG_VERSION"))
    );
}

/// The `delayd.toml` of the cluster's ConfigMap (the block scalar under its key), unindented.
fn cluster_configmap_file() -> String {
    let yaml =
        std::fs::read_to_string(format!("{DEPLOY}/kubernetes/cluster/configmap.yaml")).unwrap();
    let mut lines = yaml.lines().skip_while(|line| *line != "  delayd.toml: |");
    assert!(lines.next().is_some(), "no delayd.toml key in {yaml}");
    let mut file = String::new();
    for line in lines.take_while(|line| line.is_empty() || line.starts_with("    ")) {
        file.push_str(line.get(4..).unwrap_or(""));
        file.push('\n');
    }
    file
}

/// Whether the members' metrics, as scraped, show one term and a leader that reports member 3's lag.
fn settled(scraped: &[(u64, BTreeMap<String, f64>)]) -> bool {
    let terms: BTreeSet<Option<u64>> = (scraped.iter())
        .map(|(_, series)| series.get("delayd_cluster_term").map(|term| *term as u64))
        .collect();
    let lag = r#"delayd_cluster_peer_lag_entries{peer="3"}"#;
    terms.len() == 1
        && scraped.iter().any(|(_, series)| {
            series.get("delayd_cluster_leader") == Some(&1.0) && series.contains_key(lag)
        })
}

/// The cluster kit as the StatefulSet runs it, on loopback: members started from the ConfigMap's
/// file, each told its id and the shared secret by DELAYD_CLUSTER_NODE_ID and DELAYD_CLUSTER_SECRET,
/// its members' DNS names (delayd-N.delayd-peers) pointed at loopback ports. Two of the three form the
/// cluster (member 3's pod is, say, Pending). Then every `delayd_cluster_*` name the dashboard and the
/// alerts use is exported by a member, and what the alerts assume holds: the leader reports a lag
/// for every other member, the absent one included (DelaydClusterMemberUnreachable counts them), and
/// the members agree on the term.
#[test]
fn members_started_from_the_cluster_configmap_export_what_the_alerts_name() {
    let named: BTreeSet<String> = named_by_deploy()
        .into_iter()
        .filter(|name| name.starts_with(CLUSTER_METRICS))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    // Each member's api and peer port, six ports that differ: each is held until all are found (a
    // port asked for and let go may be handed out again at once).
    let held: Vec<std::net::TcpListener> = (0..6)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let ports: Vec<(u16, u16)> = (held.chunks(2))
        .map(|pair| {
            let port = |listener: &std::net::TcpListener| listener.local_addr().unwrap().port();
            (port(&pair[0]), port(&pair[1]))
        })
        .collect();
    drop(held);
    let mut text = cluster_configmap_file();
    for (id, (api, peer)) in (1..).zip(&ports) {
        let (api_name, peer_name) = (
            format!("\"http://delayd-{id}.delayd-peers:7070\""),
            format!("\"delayd-{id}.delayd-peers:7171\""),
        );
        assert!(
            text.contains(&api_name) && text.contains(&peer_name),
            "member {id} is not {api_name} and {peer_name} in\n{text}"
        );
        text = text
            .replace(&api_name, &format!("\"http://127.0.0.1:{api}\""))
            .replace(&peer_name, &format!("\"127.0.0.1:{peer}\""));
    }
    let config = write_file(dir.path(), "delayd.toml", &text);
    let secret = "0123456789abcdef0123456789abcdef";
    let mut members: Vec<(u64, Process)> = (1..=2u64)
        .zip(&ports)
        .map(|(id, (api, peer))| {
            let env = [
                ("DELAYD_CLUSTER_NODE_ID", id.to_string()),
                ("DELAYD_CLUSTER_SECRET", secret.to_string()),
                // As the StatefulSet's DELAYD_LISTEN, and the file's cluster.listen, on a port of
                // the member's own.
                ("DELAYD_LISTEN", format!("127.0.0.1:{api}")),
                ("DELAYD_CLUSTER_LISTEN", format!("127.0.0.1:{peer}")),
                ("DELAYD_MIN_FREE_DISK_BYTES", "0".to_string()),
            ];
            let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let data = dir.path().join(format!("data-{id}"));
            (id, spawn_member(&config, &data, &env))
        })
        .collect();
    for (_, member) in &mut members {
        member.wait_ready_within(Duration::from_secs(60));
    }
    for (id, member) in &members {
        let status = request(&member.base, "GET", "/v1/cluster", None, None);
        assert_eq!(status.status, 200, "{}", status.json);
        assert_eq!(status.json["node_id"], *id, "{}", status.json);
        assert_eq!(status.json["members"].as_array().unwrap().len(), 3);
    }

    // The metrics follow Raft's within a second or so: the leader's lags once it leads, a follower's
    // term once it heard of the election.
    let mut last = Vec::new();
    wait_for(
        "the leader's lags, one term",
        Duration::from_secs(30),
        || {
            last = (members.iter())
                .map(|(id, member)| (*id, scrape(&member.base)))
                .collect();
            settled(&last)
        },
    );
    let exported = last.iter().flat_map(|(_, series)| series.keys());
    assert_exported(&named, exported, "the members");
    // A member's unlabelled counters exist from its start, for increase() and rate() (the founding
    // election comes before the member's first report of its metrics).
    for (id, series) in &last {
        for counter in [
            "delayd_cluster_elections_total",
            "delayd_cluster_forwarded_requests_total",
        ] {
            assert!(series.contains_key(counter), "member {id}: no {counter}");
        }
    }
    let (leader, series) = (last.iter())
        .find(|(_, series)| series.get("delayd_cluster_leader") == Some(&1.0))
        .unwrap();
    let follower = if *leader == 1 { 2 } else { 1 };
    for peer in [follower, 3] {
        let lag = format!(r#"delayd_cluster_peer_lag_entries{{peer="{peer}"}}"#);
        assert!(
            series.contains_key(&lag),
            "leader {leader}: no {lag} in {series:#?}"
        );
    }
    // What GET /v1/cluster says of the member that never answered, the alert reads from the lag.
    let leader_base = &members[(*leader - 1) as usize].1.base;
    let status = request(leader_base, "GET", "/v1/cluster", None, None);
    let absent = (status.json["members"].as_array().unwrap().iter())
        .find(|member| member["id"] == 3)
        .unwrap();
    assert_eq!(absent["state"], "unreachable", "{}", status.json);
}
