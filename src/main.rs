//! The `delayd` command: `serve` runs the service; `send`, `tail` and `inspect` are tools around it.

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use delayd::config::{Config, Flags, LogFormat};
use serde_json::{json, Value};
use std::io::Read;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "delayd",
    version,
    about = "A durable, millisecond-precise delay / scheduled-message service"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the service (embedded defaults: data in ./data, listening on 127.0.0.1:7070)
    Serve(ServeArgs),
    /// Schedule one message through the HTTP API
    Send(SendArgs),
    /// Print the messages of a broker topic as they arrive, one JSON object per line (the pulled
    /// message, with its queue)
    Tail(TailArgs),
    /// Dump a data file (WAL, schedule segment or index, dispatch log, checkpoint, meta; the broker's
    /// commit log, consume queues, checkpoints, group offsets) and verify its checksums
    Inspect {
        /// The file to read
        path: PathBuf,
    },
    /// Exit 0 when the service answers GET /readyz with 200 (recovered, storage working; a full
    /// disk still answers 200), 1 otherwise: a container health check that needs no curl
    Probe(ProbeArgs),
    /// A cluster's members: show them, add one, remove one (through any member's HTTP API)
    #[command(subcommand)]
    Cluster(ClusterCommand),
}

#[derive(Debug, Subcommand)]
enum ClusterCommand {
    /// The cluster as the member at --url sees it: its leader, term, indexes and members
    Status {
        #[command(flatten)]
        client: Client,
    },
    /// Add a member (started with `join = true`): a learner until it has caught up, then a voter.
    /// Waits while it catches up, up to --wait
    Add {
        #[command(flatten)]
        client: Client,
        /// The member's id: a whole number above 0, no other member's
        #[arg(long)]
        id: u64,
        /// Its client listener, http://host:port
        #[arg(long)]
        api: String,
        /// Its peer listener as the others reach it, host:port
        #[arg(long)]
        peer: String,
        /// How long to wait for it to catch up, at most
        #[arg(long, default_value = "10m")]
        wait: String,
    },
    /// Remove a member (a voter or a learner); the leader may remove itself
    Remove {
        #[command(flatten)]
        client: Client,
        /// The member's id
        id: u64,
    },
}

#[derive(Debug, Args)]
struct ProbeArgs {
    /// The address the service listens on (a wildcard such as 0.0.0.0 is probed on loopback)
    #[arg(long, env = "DELAYD_LISTEN", default_value = "127.0.0.1:7070")]
    listen: String,
    /// The service's URL instead, as for `send` and `tail` (e.g. https://delayd.internal:7070; its
    /// /readyz is probed; a URL with a path is probed as it is)
    #[arg(long, env = "DELAYD_URL")]
    url: Option<String>,
    /// How long to wait for the answer, e.g. 2s
    #[arg(long, default_value = "5s")]
    timeout: String,
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// TOML configuration file
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Address to listen on, e.g. 127.0.0.1:7070 (port 0 picks a free one)
    #[arg(long)]
    listen: Option<String>,
    /// "always" or an interval such as "5ms"
    #[arg(long)]
    fsync: Option<String>,
    #[arg(long)]
    segment_minutes: Option<u16>,
    /// text or json
    #[arg(long, value_parser = ["text", "json"])]
    log_format: Option<String>,
    /// A bearer token accepted on /v1/* (repeatable); turns authentication on
    #[arg(long = "auth-token")]
    auth_tokens: Vec<String>,
}

#[derive(Debug, Args)]
struct Client {
    /// The service's address
    #[arg(long, env = "DELAYD_URL", default_value = "http://127.0.0.1:7070")]
    url: String,
    /// Bearer token, when the service has authentication on
    #[arg(long, env = "DELAYD_TOKEN")]
    token: Option<String>,
}

#[derive(Debug, Args)]
struct SendArgs {
    #[command(flatten)]
    client: Client,
    #[arg(long)]
    topic: String,
    /// e.g. 30s, 5m, 2h, 7d
    #[arg(long, group = "when")]
    delay: Option<String>,
    /// RFC 3339, e.g. 2026-12-01T09:30:00Z
    #[arg(long, group = "when")]
    deliver_at: Option<String>,
    /// RocketMQ delay level, 1..=18
    #[arg(long, group = "when")]
    delay_level: Option<u32>,
    #[arg(long)]
    key: Option<String>,
    /// name=value (repeatable)
    #[arg(long = "header")]
    headers: Vec<String>,
    #[arg(long)]
    sink: Option<String>,
    /// The message body; "-" reads standard input
    body: String,
}

#[derive(Debug, Args)]
struct TailArgs {
    #[command(flatten)]
    client: Client,
    #[arg(long)]
    topic: String,
    /// One queue; all queues when absent
    #[arg(long)]
    queue: Option<u32>,
    /// Where to start in the queues the group has no offset for. end: the messages that arrive after
    /// tail starts (for a topic that does not exist yet, every message from its first); beginning: also
    /// what the queues already hold
    #[arg(long, value_enum, default_value_t = Start::End)]
    from: Start,
    /// The older spelling of --from beginning
    #[arg(long, hide = true, conflicts_with = "from")]
    from_beginning: bool,
    /// Consumer group: start from its offsets and commit them as messages are printed
    #[arg(long)]
    group: Option<String>,
    /// Exit after this many messages
    #[arg(long)]
    count: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Start {
    Beginning,
    End,
}

fn main() -> std::process::ExitCode {
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            // The cause chain on one line; no backtrace: these are operator-facing messages.
            eprintln!("delayd: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(args) => serve(args),
        Command::Send(args) => send(args),
        Command::Tail(args) => tail(args),
        Command::Probe(args) => probe(args),
        Command::Cluster(command) => cluster(command),
        Command::Inspect { path } => {
            let out = &mut std::io::stdout().lock();
            let clean = match delayd::broker::inspect(&path, out) {
                Ok(Some(clean)) => Ok(clean),
                Ok(None) => schedulelog::inspect(&path, out),
                Err(e) => Err(e),
            }
            .with_context(|| format!("reading {}", path.display()))?;
            if !clean {
                std::process::exit(1);
            }
            Ok(())
        }
    }
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let flags = Flags {
        data_dir: args.data_dir,
        listen: args.listen,
        fsync: args.fsync,
        segment_minutes: args.segment_minutes,
        log_format: args.log_format.as_deref().map(|f| {
            if f == "json" {
                LogFormat::Json
            } else {
                LogFormat::Text
            }
        }),
        auth_tokens: args.auth_tokens,
    };
    let env = std::env::vars()
        .filter(|(k, _)| k.starts_with("DELAYD_") && k != "DELAYD_URL" && k != "DELAYD_TOKEN");
    let config = Config::load(args.config.as_deref(), env, &flags)?;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,openraft=warn".into());
    match config.log_format {
        // Colours only for a terminal: journald, files and log shippers get plain text.
        LogFormat::Text => tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
            .init(),
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .init(),
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&config.listen)
            .await
            .with_context(|| format!("binding {}", config.listen))?;
        // Scripts and tests read this line to learn the port when listening on port 0. It comes before
        // recovery: readiness is the line below, and GET /readyz.
        println!("delayd listening on http://{}", listener.local_addr()?);
        raise_fd_limit();
        delayd::run_with_ready(
            config,
            listener,
            std::sync::Arc::new(schedulelog::SystemClock),
            |ready| {
                println!("delayd ready on http://{}", ready.address);
                delayd::notify::notify("READY=1");
            },
            async {
                shutdown_signal().await;
                delayd::notify::notify("STOPPING=1");
            },
        )
        .await
    })
}

/// Raises the open-file limit's soft value to its hard one, and says what it is: every connection and
/// every open storage file takes a descriptor (see `delayd::edge::fds`). Logged after the address line,
/// which scripts read first.
fn raise_fd_limit() {
    match delayd::edge::fds::raise_limit() {
        Ok(raised) if raised.after > raised.before => tracing::info!(
            from = raised.before,
            to = raised.after,
            "raised the open-file limit (RLIMIT_NOFILE) to its hard limit"
        ),
        Ok(raised) => tracing::info!(
            limit = raised.after,
            "the open-file limit (RLIMIT_NOFILE) is at its hard limit"
        ),
        Err(error) => {
            tracing::warn!(%error, "the open-file limit (RLIMIT_NOFILE) could not be raised")
        }
    }
}

async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    let mut terminate =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = interrupt => {},
        _ = async { match terminate.as_mut() { Some(s) => { s.recv().await; } None => std::future::pending().await } } => {},
    }
}

/// GET /readyz once: Ok when it answers 200.
fn probe(args: ProbeArgs) -> anyhow::Result<()> {
    let url = match args.url {
        Some(url) => readyz_url(&url)?,
        None => {
            let mut address: std::net::SocketAddr = args.listen.parse().with_context(|| {
                format!("--listen {:?} is not an IP address and port", args.listen)
            })?;
            if address.ip().is_unspecified() {
                address.set_ip(match address {
                    std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                    std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
                });
            }
            format!("http://{address}/readyz")
        }
    };
    let timeout = delayd::config::parse_duration(&args.timeout)
        .map_err(|e| anyhow::anyhow!("--timeout {:?}: {e}", args.timeout))?;
    // No proxy: the probe asks this host's own service, whatever HTTP_PROXY the container has.
    let response = reqwest::blocking::Client::builder()
        .timeout(timeout)
        .no_proxy()
        .build()
        .context("building the HTTP client")?
        .get(&url)
        .send()
        .with_context(|| format!("GET {url}"))?;
    let status = response.status();
    let body = response.text().unwrap_or_default();
    if status != reqwest::StatusCode::OK {
        bail!("GET {url}: HTTP {status}: {}", body.trim());
    }
    println!("{}", body.trim());
    Ok(())
}

/// `/readyz` of the service at `url`; a URL that names a path already is taken as it is.
fn readyz_url(url: &str) -> anyhow::Result<String> {
    let parsed = reqwest::Url::parse(url).with_context(|| format!("--url {url:?} is not a URL"))?;
    Ok(match parsed.path() {
        "" | "/" => parsed.join("/readyz")?.to_string(),
        _ => url.to_string(),
    })
}

/// The CLI's HTTP client: the webhooks' (reqwest), in its blocking form.
fn agent() -> anyhow::Result<reqwest::blocking::Client> {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .context("building the HTTP client")
}

/// Sends a request and returns the status and the JSON answer (Null when the body is not JSON).
fn exchange(
    client: &Client,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> anyhow::Result<(u16, Value)> {
    let url = format!("{}{path}", client.url.trim_end_matches('/'));
    let agent = agent()?;
    let mut request = match (method, body) {
        ("GET", _) => agent.get(&url),
        ("PUT", Some(body)) => agent.put(&url).json(body),
        ("DELETE", None) => agent.delete(&url),
        (_, Some(body)) => agent.post(&url).json(body),
        _ => bail!("unsupported request"),
    };
    if let Some(token) = &client.token {
        request = request.bearer_auth(token);
    }
    let response = request.send().with_context(|| format!("{method} {url}"))?;
    let status = response.status().as_u16();
    let value: Value = response.json().unwrap_or(Value::Null);
    Ok((status, value))
}

/// Sends a request and returns the JSON answer, or fails with the problem's detail.
fn call(client: &Client, method: &str, path: &str, body: Option<&Value>) -> anyhow::Result<Value> {
    let (status, value) = exchange(client, method, path, body)?;
    if !(200..300).contains(&status) {
        return Err(problem(method, path, status, &value));
    }
    Ok(value)
}

fn problem(method: &str, path: &str, status: u16, value: &Value) -> anyhow::Error {
    let detail = value["detail"].as_str().unwrap_or("no detail");
    let code = value["code"].as_str().unwrap_or("?");
    anyhow::anyhow!("{method} {path}: {status} {code}: {detail}")
}

/// `(min_offset, max_offset)` of each queue of a topic; None while the topic does not exist (it does once
/// a message was delivered to it).
fn queue_offsets(client: &Client, topic: &str) -> anyhow::Result<Option<Vec<(u64, u64)>>> {
    let path = format!("/v1/topics/{topic}");
    let (status, info) = exchange(client, "GET", &path, None)?;
    match status {
        404 => Ok(None),
        200 => Ok(Some(
            info["queues"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|q| {
                    let offset = |name: &str| q[name].as_u64().unwrap_or(0);
                    (offset("min_offset"), offset("max_offset"))
                })
                .collect(),
        )),
        _ => Err(problem("GET", &path, status, &info)),
    }
}

fn cluster(command: ClusterCommand) -> anyhow::Result<()> {
    let status = match command {
        ClusterCommand::Status { client } => call(&client, "GET", "/v1/cluster", None)?,
        ClusterCommand::Add {
            client,
            id,
            api,
            peer,
            wait,
        } => {
            let wait = delayd::config::parse_duration(&wait)
                .map_err(|e| anyhow::anyhow!("--wait {wait:?}: {e}"))?;
            let deadline = std::time::Instant::now() + wait;
            let member = json!({"id": id, "api": api, "peer": peer});
            loop {
                let (status, answer) =
                    exchange(&client, "POST", "/v1/cluster/members", Some(&member))?;
                let catching_up = status == 503 && answer["code"] == "member_catching_up";
                if catching_up && std::time::Instant::now() < deadline {
                    eprintln!("{}", answer["detail"].as_str().unwrap_or("catching up"));
                    std::thread::sleep(Duration::from_secs(2));
                    continue;
                }
                if !(200..300).contains(&status) {
                    return Err(problem("POST", "/v1/cluster/members", status, &answer));
                }
                break answer;
            }
        }
        ClusterCommand::Remove { client, id } => {
            let path = format!("/v1/cluster/members/{id}");
            call(&client, "DELETE", &path, None)?
        }
    };
    print_cluster(&status);
    Ok(())
}

/// A cluster's status as a table: one line per member.
fn print_cluster(status: &Value) {
    let leader = status["leader_id"].as_u64();
    println!(
        "member {} sees: leader {}, term {}, committed {}, applied {}",
        status["node_id"],
        leader.map_or("none".to_string(), |l| l.to_string()),
        status["term"],
        status["commit_index"],
        status["applied_index"]
    );
    println!(
        "{:>4}  {:<12} {:<6} {:>10}  {:<28} peer",
        "id", "state", "voter", "matched", "api"
    );
    for member in status["members"].as_array().into_iter().flatten() {
        let matched = member["matched_index"]
            .as_u64()
            .map_or("-".to_string(), |m| m.to_string());
        println!(
            "{:>4}  {:<12} {:<6} {:>10}  {:<28} {}",
            member["id"],
            member["state"].as_str().unwrap_or("?"),
            member["voter"],
            matched,
            member["api"].as_str().unwrap_or("?"),
            member["peer"].as_str().unwrap_or("?")
        );
    }
}

fn send(args: SendArgs) -> anyhow::Result<()> {
    let body = if args.body == "-" {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text)?;
        text
    } else {
        args.body
    };
    let mut request = json!({"topic": args.topic, "body": body});
    match (args.delay, args.deliver_at, args.delay_level) {
        (Some(delay), _, _) => request["delay"] = json!(delay),
        (_, Some(at), _) => request["deliver_at"] = json!(at),
        (_, _, Some(level)) => request["delay_level"] = json!(level),
        _ => request["delay"] = json!(0),
    }
    if let Some(key) = args.key {
        request["key"] = json!(key);
    }
    if let Some(sink) = args.sink {
        request["sink"] = json!(sink);
    }
    let mut headers = serde_json::Map::new();
    for header in args.headers {
        let (name, value) = header
            .split_once('=')
            .with_context(|| format!("--header {header:?}: expected name=value"))?;
        headers.insert(name.into(), json!(value));
    }
    request["headers"] = Value::Object(headers);
    let answer = call(&args.client, "POST", "/v1/messages", Some(&request))?;
    println!("{answer}");
    Ok(())
}

fn tail(args: TailArgs) -> anyhow::Result<()> {
    let topic = &args.topic;
    // A name no topic can have would be waited for for ever.
    if !delayd::broker::valid_topic(topic) {
        bail!(
            "{topic:?} is not a topic name: 1 to 200 of A-Z a-z 0-9 . _ -, not all dots (or $dead)"
        );
    }
    let from = if args.from_beginning {
        Start::Beginning
    } else {
        args.from
    };
    // Where each queue starts is fixed now, when tail starts, not when it gets to poll the queue: a
    // message delivered meanwhile is printed, not skipped. A topic that does not exist yet has nothing
    // in it: every queue starts at offset 0 (its beginning and its end at this moment), however late
    // tail learns how many queues it has.
    let starts: Vec<u64> = match queue_offsets(&args.client, topic)? {
        Some(queues) => queues
            .iter()
            .map(|&(min, max)| if from == Start::Beginning { min } else { max })
            .collect(),
        None => {
            eprintln!("delayd tail: topic {topic:?} does not exist yet; waiting for it, to print it from its first message");
            loop {
                // On a missing topic this long poll waits for the next delivery to any topic.
                let wait = format!("/v1/topics/{topic}/queues/0/messages?wait_ms=20000");
                let (status, answer) = exchange(&args.client, "GET", &wait, None)?;
                if status != 200 && status != 404 {
                    return Err(problem("GET", &wait, status, &answer));
                }
                if let Some(queues) = queue_offsets(&args.client, topic)? {
                    break vec![0; queues.len()];
                }
            }
        }
    };
    let queues: Vec<u32> = match args.queue {
        Some(q) if (q as usize) < starts.len() => vec![q],
        Some(q) => bail!(
            "topic {topic:?} has {} queues; there is no queue {q}",
            starts.len()
        ),
        None => (0..starts.len() as u32).collect(),
    };
    let committed = match &args.group {
        Some(group) => call(
            &args.client,
            "GET",
            &format!("/v1/groups/{group}/offsets/{topic}"),
            None,
        )?,
        None => json!({"queues": []}),
    };
    // A group's committed offset wins over --from.
    let mut offsets: Vec<u64> = queues
        .iter()
        .map(|q| {
            committed["queues"]
                .as_array()
                .and_then(|qs| qs.iter().find(|e| e["queue"] == json!(q)))
                .and_then(|e| e["offset"].as_u64())
                .unwrap_or(starts[*q as usize])
        })
        .collect();
    let listed: Vec<String> = queues
        .iter()
        .zip(&offsets)
        .map(|(q, o)| format!("{q}:{o}"))
        .collect();
    eprintln!(
        "delayd tail: topic {topic:?}, from queue:offset {}",
        listed.join(" ")
    );
    let mut printed = 0u64;
    loop {
        // With one queue, long-poll it; with several, poll each briefly in turn.
        let wait = if queues.len() == 1 { 20_000 } else { 500 };
        for (i, queue) in queues.iter().enumerate() {
            let path = format!(
                "/v1/topics/{topic}/queues/{queue}/messages?offset={}&max=256&wait_ms={wait}",
                offsets[i]
            );
            let answer = call(&args.client, "GET", &path, None)?;
            let skipped = answer["skipped"].as_u64().unwrap_or(0);
            if skipped > 0 {
                eprintln!(
                    "delayd tail: queue {queue}: {skipped} messages from offset {} were deleted by retention before they were read",
                    offsets[i]
                );
            }
            for message in answer["messages"].as_array().into_iter().flatten() {
                // Offsets count per queue: the queue tells two messages at one offset apart.
                let mut message = message.clone();
                if let Some(fields) = message.as_object_mut() {
                    fields.insert("queue".into(), json!(queue));
                }
                println!("{message}");
                printed += 1;
                if args.count.is_some_and(|c| printed >= c) {
                    offsets[i] = message["offset"].as_u64().unwrap_or(offsets[i]) + 1;
                    commit(&args, *queue, offsets[i])?;
                    return Ok(());
                }
            }
            let next = answer["next_offset"].as_u64().unwrap_or(offsets[i]);
            if next != offsets[i] {
                offsets[i] = next;
                commit(&args, *queue, next)?;
            }
        }
    }
}

fn commit(args: &TailArgs, queue: u32, offset: u64) -> anyhow::Result<()> {
    if let Some(group) = &args.group {
        let path = format!("/v1/groups/{group}/offsets/{}/{queue}", args.topic);
        call(&args.client, "PUT", &path, Some(&json!({"offset": offset})))?;
    }
    Ok(())
}
